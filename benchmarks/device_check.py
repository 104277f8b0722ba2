"""Everything an accelerator session should measure, in one command and one report file.

    bash benchmarks/device_check.sh [REPORT.md]       # = python -m benchmarks.device_check

On a machine with a GPU (or TPU), in this order, each step under its own time limit so the
whole stays under `--budget` seconds (default 480):
1. the kernel tests with compiled kernels (KVJAX_PALLAS_INTERPRET=0);
2. `python -m pallas_kernels.gpu_check --skip-tests`: kernel against reference per op;
3. `python -m benchmarks.decode_attention`: decode attention's bandwidth as a share of the
   device's streaming read (and of its nominal HBM peak), dense vs paged, float and int8
   pages;
4. `python -m benchmarks.roofline --no-peer`: prefill against the matmul rate and decode
   against the bandwidth bound, on the default model.
Without an accelerator every step still runs end to end at toy sizes (interpret mode for
the kernels) except step 1, which is skipped with the reason: the report says which ran
how. Each step's output goes into the report (`docs/performance.md`, "The device check",
shows its format); a step that fails or runs out of time is reported as such and the
next one runs. Exit code: 0 when every step that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNEL_TESTS = (
    "tests/test_kernel_paged_attention.py",
    "tests/test_kernel_output_impact.py",
    "tests/test_kernel_group_importance.py",
)


def _backend() -> tuple[str, str]:
  out = subprocess.run(
      [sys.executable, "-c", "import jax; d = jax.devices()[0]; "
       "print(jax.default_backend()); print(getattr(d, 'device_kind', d.platform))"],
      capture_output=True, text=True, timeout=120, cwd=ROOT,
  )  # fmt: skip
  if out.returncode:
    raise SystemExit(f"device_check: jax does not start here: {out.stderr.strip()[-300:]}")
  backend, kind = out.stdout.split("\n")[:2]
  return backend.strip(), kind.strip()


def _text(out) -> str:
  """What a timed-out child wrote so far (bytes even with text=True, or None)."""
  return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def steps(accelerator: bool, report_dir: pathlib.Path) -> list[tuple[str, list[str], dict, str]]:
  """(title, command, extra environment, why skipped or "") per step."""
  py = sys.executable
  if accelerator:
    return [
        ("Kernel tests, compiled kernels",
         [py, "-m", "pytest", *KERNEL_TESTS, "-q", "-rs", "-p", "no:cacheprovider", "-n0"],
         {"KVJAX_PALLAS_INTERPRET": "0"}, ""),
        ("Kernels against their references", [py, "-m", "pallas_kernels.gpu_check", "--skip-tests"],
         {}, ""),
        ("Decode attention against the bandwidth",
         [py, "-m", "benchmarks.decode_attention", "--json", str(report_dir / "decode_attention.json")],
         {}, ""),
        ("Prefill and decode on a roofline",
         [py, "-m", "benchmarks.roofline", "--no-peer", "--json", str(report_dir / "roofline.json")],
         {}, ""),
    ]  # fmt: skip
  return [
      ("Kernel tests, compiled kernels", [], {},
       "no GPU or TPU here: compiled Pallas kernels need one (the default test suite runs "
       "these tests in interpret mode)"),
      ("Kernels against their references (interpret mode, toy sizes)",
       [py, "-m", "pallas_kernels.gpu_check", "--skip-tests", "--dry-run"], {}, ""),
      ("Decode attention against the bandwidth (toy sizes)",
       [py, "-m", "benchmarks.decode_attention", "--tokens", "512", "2048", "--batch", "2",
        "--kv-heads", "2", "--head-dim", "64", "--dtype", "float32", "--iters", "3",
        "--stream-mib", "128", "--json", str(report_dir / "decode_attention.json")], {}, ""),
      ("Prefill and decode on a roofline (short prompt)",
       [py, "-m", "benchmarks.roofline", "--no-peer", "--prefill-tokens", "256", "--contexts",
        "256", "--repeats", "1", "--decode-steps", "4", "--json",
        str(report_dir / "roofline.json")], {}, ""),
  ]  # fmt: skip


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("report", nargs="?", default="device_check.md", help="the report file")
  parser.add_argument("--budget", type=float, default=480.0, help="seconds for all steps")
  args = parser.parse_args(argv)
  if args.budget < 60:
    parser.error(f"--budget must be at least 60 seconds, got {args.budget}")
  report = pathlib.Path(args.report).resolve()
  report_dir = report.parent / (report.stem + "_files")
  report_dir.mkdir(parents=True, exist_ok=True)
  start = time.monotonic()
  backend, kind = _backend()
  accelerator = backend in ("gpu", "tpu")
  plan = steps(accelerator, report_dir)
  # Shares of the budget: the tests and the roofline take the most.
  shares = [0.35, 0.15, 0.2, 0.3] if accelerator else [0.0, 0.3, 0.2, 0.5]
  lines = [
      "# kvjax device check",
      "",
      f"{time.strftime('%Y-%m-%d %H:%M:%S')}; backend {backend}, device {kind}; "
      f"{platform.machine()}, {os.cpu_count()} CPUs; python {platform.python_version()}.",
      ""
      if accelerator
      else "No accelerator: kernel steps ran in interpret mode at toy sizes; "
      "the numbers below say only that every step runs.",
      "",
  ]
  failed = False
  env_base = dict(os.environ, PYTHONUNBUFFERED="1")
  for (title, command, env, skipped), share in zip(plan, shares):
    lines.append(f"## {title}\n")
    if skipped:
      lines.append(f"Skipped: {skipped}.\n")
      continue
    left = args.budget - (time.monotonic() - start)
    limit = max(30.0, min(left, share * args.budget + max(0.0, left - sum(shares) * args.budget)))
    shown = " ".join(pathlib.Path(c).name if c == sys.executable else c for c in command)
    lines.append(f"`{shown}`" + (f" with {env}" if env else "") + "\n")
    t0 = time.monotonic()
    try:
      done = subprocess.run(
          command, cwd=ROOT, env=dict(env_base, **env), capture_output=True, text=True,
          timeout=limit,
      )  # fmt: skip
      rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
      rc, output = None, _text(e.stdout) + _text(e.stderr)
    seconds = time.monotonic() - t0
    status = "timed out" if rc is None else ("passed" if rc == 0 else f"failed (exit {rc})")
    failed |= rc != 0
    # Progress bars and pytest's dots are noise in a report: keep the lines that say things.
    kept = [
        line for line in output.splitlines()
        if line.strip() and "it/s]" not in line and not set(line.strip()) <= set(".sxF[]%0123456789 ")
    ]  # fmt: skip
    lines.append(f"{status} in {seconds:.0f} s (limit {limit:.0f} s).\n")
    lines.append("```\n" + "\n".join(kept[-60:]) + "\n```\n")
    print(f"device_check: {title}: {status} in {seconds:.0f} s", flush=True)
  lines.append(f"Total {time.monotonic() - start:.0f} s of a {args.budget:.0f} s budget.")
  partial = report.with_name(report.name + ".partial")
  partial.write_text("\n".join(lines) + "\n")
  partial.replace(report)  # the report appears whole or not at all
  print(f"device_check: report in {report}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
