def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running GPU test (the 10 000-step soak); deselect with -m 'gpu and not slow'")
