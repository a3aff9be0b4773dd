"""A rank function of tests/test_group.py in a module that reads the environment when it is imported, as
prometheus_client does (its multiprocess mode from PROMETHEUS_MULTIPROC_DIR): a rank imports it while
loading the function."""

import os

AT_IMPORT = os.environ.get("MOE_COMM_TEST_LAUNCH_ENV")


def imported_env(group):
    return AT_IMPORT
