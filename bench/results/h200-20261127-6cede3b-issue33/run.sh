# Issue 33 on one GPU: timed-out receives (new tree vs dd5c2bc), sanitizers, happy-path kernel times.
set -u; export PYTHONUNBUFFERED=1; L=/tmp/logs; mkdir -p $L /tmp/kn /tmp/ko /tmp/kw; NEW=$PWD; OLD=$PWD/.gpu_old
F=$OUT/faults.jsonl; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" >> $OUT/timeline.txt; }
logs() { for f in $L/*.log; do echo "=== $f"; grep -v '^{' $f | tail -n 40; done > $OUT/logs.txt 2>&1; }
{ nvidia-smi -L; python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__,'cuda',torch.version.cuda)"; echo "new: $MOE_COMMIT; old: dd5c2bc"; date -u; } > $OUT/env.txt 2>&1
trep() { d=$1; shift; (cd $d && PYTHONPATH=$d python3 bench/timeout_repeats.py --json $F "$@"); }
kb() { d=$1; o=$2; shift 2; (cd $d && PYTHONPATH=$d python3 bench/kernels.py --sections floor,ep_emulated --emulated-tokens 1,128 --out-dir $o "$@"); }
export -f trep kb; export F; el start
( timeout 100 bash -c "trep $NEW --ops dispatch,combine,alltoallv,prefill --repeats 500 --timeouts-ms 2 --jobs 4 --case-timeout-s 90" > $L/new2.log 2>&1; el new2ms-done
  timeout 55 bash -c "trep $NEW --ops dispatch,combine,alltoallv,prefill --repeats 60 --timeouts-ms 50 --jobs 4 --case-timeout-s 45" > $L/new50.log 2>&1; el new50ms-done ) &
( timeout 150 bash -c "trep $OLD --ops dispatch --repeats 300 --timeouts-ms 2 --exact-every 10 --case-timeout-s 70; trep $OLD --ops dispatch --repeats 300 --timeouts-ms 2 --exact-every 10 --warps 1 --case-timeout-s 70" > $L/old.log 2>&1; el old-done ) &
( for tool in racecheck synccheck; do timeout 75 compute-sanitizer --tool $tool --error-exitcode 9 python3 bench/timeout_repeats.py --one dispatch 20 --repeats 2 --shape small > $L/$tool.log 2>&1; echo "$tool exit $?" >> $L/$tool.log; el $tool-done; done ) &
( timeout 150 bash -c "kb $NEW /tmp/kw --iters 1 --warmup 0; kb $OLD /tmp/kw --iters 1 --warmup 0" > $L/precompile.log 2>&1; el precompile-done ) &
wait; el phaseA-done; logs
for i in 1 2; do
  timeout 35 bash -c "kb $NEW /tmp/kn --iters 50 --warmup 5 --tag new-$i" > $L/kn$i.log 2>&1; el kn$i; cat /tmp/kn/*.jsonl > $OUT/kernels_new.jsonl   # committed as kernels-new.jsonl
  timeout 35 bash -c "kb $OLD /tmp/ko --iters 50 --warmup 5 --tag old-$i" > $L/ko$i.log 2>&1; el ko$i; cat /tmp/ko/*.jsonl > $OUT/kernels_old.jsonl
done
logs; el end; cat $OUT/timeline.txt
grep -h "timeout repeats\|exit\|ERROR SUMMARY\|RACECHECK SUMMARY" $L/*.log; grep -h "ep_emul\|dispatch\|combine" $L/kn1.log $L/ko1.log | head -30
