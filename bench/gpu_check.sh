#!/usr/bin/env bash
# Everything a lent GPU host is for, in one call, within a time budget: the tests marked `gpu` (and the
# rest of the Triton/graph test files, which run at real sizes when CUDA is present), the GPU benchmarks,
# an end-to-end `serve --device cuda` check, and the C++ kernels' tests on the host CPU's own ISA
# (AVX-512 / AMX, which a development machine may lack). Steps run in the order STEPS names them; each
# gets at most what is left of the budget, so a slow step cuts the later ones rather than the whole call.
#
#   OUT=/some/dir BUDGET=420 STEPS="gpu-tests tune native-tests omnikv mla model serve cpu-tests" bash bench/gpu_check.sh
#
#   gpu-tests     Triton kernels, fused MoE, sampler (run while the native extension builds)
#   native-tests  CUDA-graph runner and hybrid placement (routed experts on the CPU): need the extension
#   cpu-tests     the C++ kernels on this host's ISA (after the timed steps: a graphed decode step still
#                 needs the host each step, and these tests on 12 of 16 cores made one 2.6x slower)
#   tune          bench/tune_decode_attention.py: the decode attention kernel's launch plans timed on this GPU
#                 (TUNE_ARGS); the fastest are written to kernels/configs/decode_attention.json here, so the
#                 later steps run them, and their report to $OUT (commit the plans from it)
#   routing       bench/hybrid_routing_gpu.py: hybrid and all-GPU placements against the fp32 CPU oracle
#                 position by position, with the router decisions that flipped
#   omnikv, mla, model   bench/omnikv_gpu.py, bench/mla_decode_gpu.py, bench/model_decode_gpu.py
#                 (by default here: graphed decodes, no bank; OmniKV at 32K-128K with batches of 1, 8 and
#                 16 over KV drawn at random (--fill random); omnikv_gpu.py alone also times eager decodes
#                 and the context bank)
#   serve         bench/serve_gpu_check.py (the server on the GPU against the same model on the CPU)
#   cpu-bench     bench/quant_linear_cpu.py on the host CPU, its AMX path against its AVX-512 one (QL_ARGS
#                 picks shapes, formats and threads)
#
# The Python packages the host lacks travel as wheels in .whl/ (bench/gpu_wheels.sh fetches them; carry
# .whl and .gpu_extra with the call), installed to /tmp/site.
# Results: $OUT/{env.txt,tests.log,bench.log,*.json}: at most 8 files, as the device tool returns.
set -u
OUT=${OUT:-$(mktemp -d)}
BUDGET=${BUDGET:-420}
STEPS=${STEPS:-"gpu-tests tune native-tests omnikv mla model serve cpu-tests"}
GPU_TESTS=${GPU_TESTS:-"tests/kernels/test_triton_attention.py tests/kernels/test_triton_omnikv.py tests/kernels/test_fused_moe.py tests/kernels/test_triton_layer_ops.py tests/executor/test_sampler.py"}
NATIVE_TESTS=${NATIVE_TESTS:-"tests/executor/test_cuda_graph_runner.py tests/executor/test_context_bank.py tests/models/test_cpp_expert_backend.py tests/cpp_experts/test_host_task.py"}
CPU_TESTS=${CPU_TESTS:-"tests/cpp_experts tests/models/test_cpp_expert_backend.py"}
OMNIKV_ARGS=${OMNIKV_ARGS:-"--contexts 32768 131072 65536 --batch 1 8 16 --graphs on --bank off --rounds 2 --fill random"}
TUNE_ARGS=${TUNE_ARGS:-"--budget 150"}
MLA_ARGS=${MLA_ARGS:-"--batches 1 8 64 --contexts 4096 32768"}
MODEL_ARGS=${MODEL_ARGS:-"--hybrid"}
QL_ARGS=${QL_ARGS:-"--shapes wide_2048 --formats q8_0 q4_0 q4_k bf16 --ms 1 16 64 --threads 4 --rounds 3"}
OMNIKV_MAX=${OMNIKV_MAX:-300}  # seconds at most for the OmniKV benchmark (128K contexts prefill for a while)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# run_step NAME MAX_SECONDS LOG CMD...: runs CMD under min(MAX, what is left), logs its time and status.
run_step() {
    local name=$1 max=$2 log=$3; shift 3
    local t; t=$(left); (( t > max )) && t=$max
    if (( t < 20 )); then echo "== $name: skipped, $(left)s left of the budget" | tee -a "$log"; return; fi
    echo "== $name (limit ${t}s) at $(( $(date +%s) - T0 ))s" >> "$log"
    local s=$(date +%s)
    timeout "$t" "$@" >> "$log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - s ))s" | tee -a "$log"
}

{
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    lscpu | grep -E 'Model name|^CPU\(s\)'
    echo "isa: $(grep -o -w -E 'amx[a-z_0-9]*|avx512[a-z_0-9]*|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# packages that are no wheels (bench/gpu_wheels.sh: the default model's tokenizer without its weights)
if [[ -d .gpu_extra ]]; then mkdir -p /tmp/site && cp -r .gpu_extra/. /tmp/site/ && export PYTHONPATH="$PYTHONPATH:/tmp/site"; fi

# The native extension (routed experts on the CPU, host nodes, the CPU kernels), built in the background
# (its files in parallel, bound by the longest: ~20 s of a core since attention's builds are files of
# their own, ~1 s when a warm host kept the build); the steps that import it wait for it first (a
# failed import would stay failed in that process).
rm -f /tmp/build.done
(s=$(date +%s); nice -n 10 python3 setup.py -q build_ext --inplace -j 16 > /tmp/build.log 2>&1
 echo "== build: rc=$? in $(( $(date +%s) - s ))s" >> /tmp/build.log; touch /tmp/build.done) &
BUILT=
wait_build() { while [[ ! -e /tmp/build.done ]]; do sleep 2; done; }
need_build() { [[ -n $BUILT ]] && return; wait_build; cat /tmp/build.log >> "$OUT/tests.log"; BUILT=1; }

for step in $STEPS; do
    case $step in
    gpu-tests) run_step "gpu tests" 200 "$OUT/tests.log" python3 -m pytest -q -p no:cacheprovider --timeout 150 $GPU_TESTS ;;
    native-tests) need_build
        run_step "gpu tests with the extension" 200 "$OUT/tests.log" python3 -m pytest -q -p no:cacheprovider \
            --timeout 150 $NATIVE_TESTS ;;
    cpu-tests) need_build
        run_step "cpu kernels on the host ISA" 240 "$OUT/tests.log" env MLASERVE_CPP_EXPERTS_THREADS=2 \
            python3 -m pytest -q -p no:cacheprovider -n 6 --timeout 200 $CPU_TESTS ;;
    tune) run_step "tune_decode_attention" 180 "$OUT/bench.log" python3 bench/tune_decode_attention.py \
            --out "$OUT/tune_decode_attention.json" $TUNE_ARGS ;;
    routing) need_build
        run_step "hybrid_routing_gpu" 90 "$OUT/bench.log" python3 bench/hybrid_routing_gpu.py --out "$OUT/routing.json" ;;
    omnikv) run_step "omnikv_gpu" "$OMNIKV_MAX" "$OUT/bench.log" python3 bench/omnikv_gpu.py --out "$OUT/omnikv_gpu.json" $OMNIKV_ARGS ;;
    mla) run_step "mla_decode_gpu" 100 "$OUT/bench.log" python3 bench/mla_decode_gpu.py --out "$OUT/mla_decode.json" $MLA_ARGS ;;
    model) [[ " $MODEL_ARGS " == *" --hybrid "* ]] && need_build  # its hybrid part imports the extension
        run_step "model_decode_gpu" 240 "$OUT/bench.log" python3 bench/model_decode_gpu.py --out "$OUT/model_decode.json" $MODEL_ARGS ;;
    serve) need_build  # the CPU side of the comparison serves with the native kernels
        run_step "serve_gpu_check" 150 "$OUT/bench.log" python3 bench/serve_gpu_check.py --out /tmp/serve/serve_gpu_check.json
        cp /tmp/serve/serve_gpu_check.json "$OUT/" 2>/dev/null
        for f in /tmp/serve/*.log; do [[ -f $f ]] && { echo "== $f"; tail -n 60 "$f"; } >> "$OUT/bench.log"; done ;;
    cpu-bench) need_build
        for k in amx avx512; do
            # llama.cpp's mul_mat (where llama-cpp-python is installed) beside the AMX run only: the step's time
            ggml=$([ "$k" = amx ] || echo --no-ggml)
            run_step "quant_linear_cpu $k" 90 "$OUT/bench.log" python3 bench/quant_linear_cpu.py $QL_ARGS --kernel $k $ggml \
                --out "$OUT/quant_linear_cpu_$k.json"
        done ;;
    *) echo "unknown step $step" ;;
    esac
done
echo "== done at $(( $(date +%s) - T0 ))s"
grep -h "^== \|passed\|failed" "$OUT/tests.log" "$OUT/bench.log" 2>/dev/null | tail -n 40
