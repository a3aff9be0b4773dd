set -u; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; L=/tmp/logs; mkdir -p $L
{ nvidia-smi -L; python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__,'cuda',torch.version.cuda)"; echo "new tree: working tree of the lead (dd5c2bc + uncommitted sync.py block-uniform fix); old tree: dd5c2bc"; date -u; } > $OUT/env.txt 2>&1
R=$OUT/results.jsonl
run() { tag=$1; dir=$2; shift 2; (cd $dir && PYTHONPATH=$PWD timeout 300 python3 bench/timeout_repeats.py --timeouts-ms 2 --case-timeout-s 260 --json $R "$@" > $L/$tag.log 2>&1; echo "$tag exit $?" >> $L/$tag.log) & }
run old_w4 .gpu_old --ops dispatch --repeats 150 --exact-every 10
run old_w1 .gpu_old --ops dispatch --repeats 150 --exact-every 10 --warps 1
run old_w8 .gpu_old --ops dispatch --repeats 150 --exact-every 10 --warps 8
run new_w4 . --ops dispatch,combine,alltoallv,prefill --repeats 200 --jobs 4
run new_w8 . --ops dispatch,combine --repeats 200 --jobs 2 --warps 8
wait
for f in $L/*.log; do echo "=== $f"; grep -v '^{' $f | tail -n 25; done > $OUT/logs.txt 2>&1
grep -h "timeout repeats\|exit" $L/*.log
