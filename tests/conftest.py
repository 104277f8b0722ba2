import os

# Tests compare float32 results at 1e-5; keep XLA's CPU matmuls at full precision.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
