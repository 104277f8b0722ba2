import os

# Tests compare float32 results at 1e-5; keep XLA's CPU matmuls at full precision.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Tests patch kvjax's code at run time, which the executable store cannot see in its keys
# (tests/test_compilation.py turns it on where it is tested).
os.environ.setdefault("KVJAX_EXECUTABLES", "off")
# Compiled steps go to a cache of this run's own, not the user's $KVJAX_CACHE_DIR: tests
# must not depend on, or leave behind, executables from other runs.
if "KVJAX_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile

  os.environ["KVJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvjax-tests-")
  atexit.register(shutil.rmtree, os.environ["KVJAX_CACHE_DIR"], True)
