# Sourced by the gpu_*.sh scripts from the repository root: installs the wheels a device machine
# lacks, placed in .whl/ (git-ignored), into /tmp/site and puts them and the checkout on PYTHONPATH.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # keeps what the caller added (FA4)
