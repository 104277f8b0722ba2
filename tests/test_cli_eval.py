"""`kvjax eval ...` and `kvjax bench` on the default model, in --quick mode."""

import json
import pathlib

import pytest

from kvjax import cli
from kvjax import eval as E
from kvjax.eval import _sweep

# A head allocation `kvjax tune` learned on kvzip's scores for the default model.
ALLOC = str(pathlib.Path(__file__).parents[1] / "docs/results/tune/shipped-text/allocation")


def _run(tmp_path, capsys, *argv):
  code = cli.main([*argv, "--quiet", "--out", str(tmp_path)])
  return code, capsys.readouterr()


@pytest.mark.parametrize(
    "argv, metric",
    [
        # fidelity through the API: test_eval; the CLI's writing of results: retention below
        pytest.param(["eval", "fidelity"], "kl", marks=pytest.mark.slow),
        pytest.param(["eval", "passkey"], "accuracy", marks=pytest.mark.slow),
        pytest.param(["eval", "multi-question"], "questions", marks=pytest.mark.slow),
        # perplexity runs through the CLI in test_user_data_text_and_jsonl (slow)
        pytest.param(["eval", "perplexity"], "ppl", marks=pytest.mark.slow),
        (["eval", "retention"], "retention"),
        pytest.param(["bench"], "decode_ms_per_token", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # heavy for the default suite (a model, a process or a search)
def test_every_subcommand_runs_quick_and_writes_its_outputs(tmp_path, capsys, argv, metric):
  code, out = _run(tmp_path, capsys, *argv, "--quick")
  assert code == 0, out.err
  results = json.loads((tmp_path / "results.json").read_text())
  E.validate_results(results)
  assert results["task"] == (argv[1].replace("-", "_") if argv[0] == "eval" else "bench")
  assert results["model"]["name"] == "smollm2-135m-instruct"
  assert results["config"]["quick"] is True and results["backend"]["platform"] == "cpu"
  policies = [r["policy"] for r in results["rows"]]
  assert policies == ["full", "streaming", "h2o"]
  assert all(r["failed"] == 0 and r["metrics"][metric] is not None for r in results["rows"])
  assert (tmp_path / "results.md").read_text() in out.out
  assert list(tmp_path.glob("*.png"))


@pytest.mark.slow  # heavy: run with -m slow
def test_passkey_reports_the_full_cache_accuracy_beside_each_policy(tmp_path, capsys):
  argv = ["eval", "passkey", "--quick", "--policy", "full", "tova", "--budget", "0.25"]
  code, out = _run(tmp_path, capsys, *argv, "--fillers", "repeat", "text")
  assert code == 0, out.err
  results = json.loads((tmp_path / "results.json").read_text())
  rows = results["rows"]
  full = rows[0]["metrics"]["accuracy"]
  assert rows[0]["policy"] == "full" and rows[1]["policy"] == "tova"
  assert "| full-cache accuracy |" in out.out
  assert f"| {100 * full:.1f}% | 0/2 |" in out.out.rstrip().splitlines()[-1]
  assert [a["filler"] for a in rows[1]["answers"]] == ["repeat", "text"]
  assert all(a["expected"].isdigit() for a in rows[1]["answers"])
  assert results["config"]["fillers"] == ["repeat", "text"]
  assert results["config"]["data"]["kind"] == "text"


@pytest.mark.slow  # CLI input formats; the eval API covers the rest by default
def test_user_data_text_and_jsonl(tmp_path, capsys):
  text = tmp_path / "mine.txt"
  text.write_text(E.default_text()[:8000])
  code, out = _run(
      tmp_path / "t",
      capsys,
      "eval",
      "perplexity",
      "--quick",
      "--policy",
      "tova",
      "--text",
      str(text),
  )
  assert code == 0, out.err
  results = json.loads((tmp_path / "t" / "results.json").read_text())
  assert results["config"]["data"] == {"kind": "text", "source": str(text), "tokens": 1615}
  qa = tmp_path / "qa.jsonl"
  qa.write_text(
      json.dumps(
          {
              "context": "Alice keeps the spare key under the blue flowerpot. " * 8,
              "question": "Where is the spare key?",
              "answer": "flowerpot",
          }
      )
      + "\n"
  )
  code, out = _run(
      tmp_path / "q", capsys, "eval", "passkey", "--policy", "full", "--jsonl", str(qa)
  )
  assert code == 0, out.err
  rows = json.loads((tmp_path / "q" / "results.json").read_text())["rows"]
  assert rows[0]["cases"] == 1 and rows[0]["answers"][0]["expected"] == "flowerpot"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "fidelity", "--policy", "h2o", "nope"], "unknown policy 'nope'"),
        (
            ["eval", "fidelity", "--policy", "h2o", "--budget", "4096", "--context-tokens", "512"],
            "budget=4096 .4096 tokens. is larger than the request of 512 tokens",
        ),
        (
            ["eval", "retention", "--policy", "h2o", "--budget", "8", "--recent", "16"],
            r"budget=8 cannot hold the protected sink=4 and recent=16",
        ),
        (["eval", "perplexity", "--text", "/nonexistent/file.txt"], "cannot read text file"),
        (["eval", "perplexity", "--text", "EMPTY"], "is empty"),
        (["eval", "fidelity", "--text", "SHORT", "--context-tokens", "1024"], "too short"),
        (
            ["eval", "passkey", "--policy", "full", "--context-tokens", "40"],
            "too short for a passkey",
        ),
        (["bench", "--context-tokens", "9000"], "exceeds the model context 8192"),
        (
            [
                "eval",
                "passkey",
                "--policy",
                "full",
                "--fillers",
                "repeat",
                "--context-tokens",
                "8192",
            ],
            "answer of up to 12 tokens pass the model context 8192: give context_tokens at most 8180",
        ),
        (["eval", "passkey", "--jsonl", "/nonexistent.jsonl"], "cannot read JSONL file"),
        (["eval", "passkey", "--fillers", "repeat", "nope"], "fillers must be a non-empty list"),
        (
            ["eval", "passkey", "--fillers", "repeat", "--text", "SHORT"],
            "--text only as the haystack of --fillers text or needles",
        ),
        (
            ["eval", "passkey", "--fillers", "text", "--text", "SHORT", "--policy", "full"],
            "too short for a window of 2048 tokens",
        ),
        (["eval", "multi-question", "--facts", "0"], "facts must be an int >= 1, got 0"),
        (
            [
                "eval",
                "fidelity",
                "--policy",
                "full",
                "h2o",
                "--budget",
                "0.5",
                "--allocation",
                ALLOC,
            ],
            "learned on policy 'kvzip', which is not among the policies",
        ),
        (["eval", "multi-question", "--trials", "0"], "trials must be an int >= 1, got 0"),
        (
            ["eval", "multi-question", "--policy", "full", "--context-tokens", "60"],
            "context_tokens=60 is too short for 4 facts",
        ),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, capsys, argv, message):
  (tmp_path / "empty.txt").write_text("\n")
  (tmp_path / "short.txt").write_text("A few words only.")
  argv = [
      {"EMPTY": str(tmp_path / "empty.txt"), "SHORT": str(tmp_path / "short.txt")}.get(a, a)
      for a in argv
  ]
  code, out = _run(tmp_path / "out", capsys, *argv)
  assert code == 2
  [line] = [x for x in out.err.splitlines() if x.startswith("kvjax")]
  assert line.startswith(f"kvjax {argv[0]}: error: ")
  assert __import__("re").search(message, line), line
  assert not (tmp_path / "out" / "results.json").exists()


def test_an_allocation_flag_applies_to_the_rows_of_its_own_policy():
  """`--allocation DIR` on a sweep: the kvzip rows (any options) use it, full and h2o not."""
  argv = ["eval", "fidelity", "--policy", "full", "kvzip", "kvzip:chunk=256", "h2o"]
  args = cli.build_parser().parse_args([*argv, "--budget", "0.25", "--allocation", ALLOC])
  spec = cli.spec_from_args(args, sweep=True)
  specs, _ = _sweep.configuration_specs(
      spec, args.policy, args.budget, [2048], allocation=args.allocation
  )
  used = {c[1]: s.allocation is not None for c, s in specs.items()}
  assert used == {"full": False, "kvzip": True, "kvzip:chunk=256": True, "h2o": False}
