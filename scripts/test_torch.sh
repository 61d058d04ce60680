#!/usr/bin/env bash
# The tests and the benchmark that need PyTorch, which neither .venv nor CI's default run has
# (its PyPI wheel is 539 MB and brings about 4 GB of CUDA libraries; it runs on CPU): installs
# torch (ECHO_TORCH_SPEC, default "torch>=2.4") once into target/torch-site (pip --target,
# kept between runs; delete it to update), then, with it on PYTHONPATH:
# - the hand-off tests (test_torch_handoff.py: sample(device="cpu"), writable=True and
#   torch.from_numpy, DLPack), the device and prefetch tests (test_prefetch.py), the
#   frameworks and the zero-copy guides' examples, and the DLPack tests of test_info.py;
# - the torch-handoff benchmark (batches/s into torch CPU tensors against numpy views), with
#   its table printed (`--quick` as the first argument: the small sizes).
# Other arguments replace the test selection.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
site=target/torch-site
if ! PYTHONPATH=$site python -c "import torch" >/dev/null 2>&1; then
  echo ">> installing ${ECHO_TORCH_SPEC:-torch>=2.4} into $site (once; about 5 GB)"
  rm -rf "$site"
  python -m pip install -q --target "$site" "${ECHO_TORCH_SPEC:-torch>=2.4}"
fi
PYTHONPATH=$site python -c "import torch; print('>> torch', torch.__version__, 'from', torch.__file__)"
quick=()
if [[ ${1:-} == --quick ]]; then
  quick=(--quick)
  shift
fi
if (($# == 0)); then
  set -- python/tests/test_torch_handoff.py python/tests/test_prefetch.py \
    python/tests/test_docs_examples.py -k "not test_docs_example or zero-copy or frameworks or gpu"
fi
PYTHONPATH=$site bash scripts/test_py.sh -p no:cacheprovider "$@"
echo ">> python -m benches torch-handoff ${quick[*]}"
PYTHONPATH=$site python -m benches torch-handoff "${quick[@]}" --out target/torch-handoff
