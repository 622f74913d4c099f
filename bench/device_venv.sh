#!/bin/bash
# A venv for the benches on a machine with no network (the GPU host: Python 3.12, no pip
# index), made from wheels carried in .whl/ (ignored by git). Fill .whl/ here first:
#   .venv/bin/pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform any -d .whl click structlog httpx \
#     prometheus-client huggingface_hub==2.4.0 starlette uvicorn python-multipart \
#     'psycopg[binary]' openai smg==1.13.0
# (then drop grpcio*, protobuf*, hf_xet*: smg's launcher and the benches do not import them).
# pystemd has no wheel: the benches run the process runtime, which does not import it.
# The venv is at /tmp/venv, linked as .venv: the batch service is started as `python -I`
# (no PYTHONPATH), so the project's agent/ is put on the venv's path with a .pth file.
set -e
cd "$(dirname "$0")/.."
if [ -e .venv ] && [ ! -L .venv ]; then
  echo "bench/device_venv.sh: $PWD/.venv is a venv of its own; this script replaces it with a" \
    "link to /tmp/venv and is meant for the GPU host's copy of the tree. Nothing changed." >&2
  exit 2
fi
if [ ! -x /tmp/venv/bin/python ]; then
  python3 -m venv --without-pip --system-site-packages /tmp/venv
  python3 -m pip --python /tmp/venv/bin/python install -q --no-index --no-deps .whl/*.whl
fi
site=$(/tmp/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/agent" > "$site/sglang_farm_dev.pth"
printf '#!/tmp/venv/bin/python\nfrom sglang_farm.cli.farmctl import main\nmain()\n' > /tmp/venv/bin/farmctl
chmod +x /tmp/venv/bin/farmctl
rm -rf .venv
ln -s /tmp/venv .venv
/tmp/venv/bin/python -I -c "import sglang_farm.service, sglang_farm.batch, openai, starlette, uvicorn"
