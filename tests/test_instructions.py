"""benchmarks/instructions.py and benchmarks/callgrind.py: counting instructions per step.

No count is asserted against a number: what is asserted is that the client requests count
exactly the code between them (nothing before counting starts, more work more instructions),
that dumps come back by name, and that the child step loop runs (natively the requests are
no-ops). The whole command on a tiny model under valgrind is marked slow: importing torch
under valgrind alone takes ~50 CPU seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import callgrind, instructions  # noqa: E402

REASON = callgrind.unavailable()
needs_callgrind = pytest.mark.skipif(REASON is not None, reason=f"no callgrind: {REASON}")


def test_parse_dump_reads_the_trigger_name_and_the_closing_total():
    text = "desc: Trigger: Client Request: hand-written#1\nsummary: 10\nfn=x\n1 10\ntotals: 12\n"
    assert callgrind.parse_dump(text) == ("hand-written#1", 12)
    assert callgrind.parse_dump("desc: Trigger: Program termination\ntotals: 5\n") == (None, 5)


def test_summarise_takes_medians_over_steps_and_processes_and_the_widest_spread():
    runs = [
        {"unrouted": [300, 300], "route()": [202, 200], "hand-written": [200, 200]},
        {"unrouted": [300, 300], "route()": [202, 202], "hand-written": [200, 200]},
    ]
    summary = instructions.summarise(runs)
    assert summary["per_step"] == {"unrouted": 300, "route()": 202, "hand-written": 200}
    assert summary["route_vs_hand"] == pytest.approx(1.01)
    assert summary["unrouted_vs_route"] == pytest.approx(300 / 202)
    assert summary["spread"] == pytest.approx(2 / 202)


def test_merge_joins_disjoint_runs_and_refuses_different_settings():
    meta = {"command": "python -m benchmarks.instructions --models a", "torch": "2.14",
            "valgrind": "3.19", "steps": 2, "warmup": 1}  # fmt: skip
    a = {"meta": meta, "models": [{"model": "a"}], "skipped": []}
    b = {"meta": dict(meta, command="... --models b"), "models": [{"model": "b"}], "skipped": ["c"]}
    merged = instructions.merge([a, b])
    assert [e["model"] for e in merged["models"]] == ["a", "b"] and merged["skipped"] == ["c"]
    assert merged["meta"]["command"].endswith("; ... --models b")
    with pytest.raises(ValueError, match="steps"):
        instructions.merge([a, dict(b, meta=dict(b["meta"], steps=3))])


def test_cli_accepts_models_steps_and_tiny():
    args = instructions.parse_args(["--models", "dit-s2", "--steps", "3", "--tiny"])
    assert (args.models, args.steps, args.tiny, args.modes) == ("dit-s2", 3, True, "eager")


@needs_callgrind
def test_client_requests_count_only_the_code_between_them(tmp_path):
    library = callgrind.build_marker(tmp_path)
    script = tmp_path / "work.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from benchmarks.callgrind import Marker
        total = sum(range(200_000))  # before counting starts: not counted
        marker = Marker({str(library)!r})
        marker.start()
        marker.zero()
        total = sum(range(1_000))
        marker.dump("small")
        total = sum(range(100_000))
        marker.dump("large")
        marker.stop()
    """)
    )
    out = tmp_path / "dumps"
    out.mkdir()
    command = callgrind.command(out, [sys.executable, str(script)])
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    dumps = callgrind.read_dumps(out)
    assert set(dumps) == {"small", "large"}
    small, large = dumps["small"][0], dumps["large"][0]
    assert 0 < small < 1_000_000  # sum(range(200_000)) before start() is left out
    assert large > 20 * small


def test_the_counted_process_takes_kernels_without_avx2():
    # under valgrind MKL's AVX2 sgemm ran ~3,000x slower than natively: a DiT-S/2 step never
    # reached its count; the counted process must dispatch to the kernels of an older CPU
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**os.environ, **instructions.COUNTED_ENV}
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "DEFAULT"


@needs_callgrind
def test_child_runs_the_three_variants_natively_on_a_tiny_model(tmp_path):
    job = dict(model="dit-s2", mode="eager", tiny=True, batch=2, seed=0, warmup=1, steps=1,
               library=str(callgrind.build_marker(tmp_path)))  # fmt: skip
    seconds = instructions.child(job)  # natively the client requests do nothing
    assert set(seconds) == {"setup", "warmup", "counted"}


@pytest.mark.slow
@needs_callgrind
def test_tiny_command_under_valgrind_writes_the_table(tmp_path):
    out = tmp_path / "instr"
    argv = ["--tiny", "--models", "dit-s2", "--steps", "1", "--warmup", "1", "--out", str(out)]
    assert instructions.main([*argv, "--quiet"]) == 0
    results = json.loads(out.with_suffix(".json").read_text())
    (entry,) = results["models"]
    assert all(n > 0 for n in entry["per_step"].values())
    assert 0.9 < entry["route_vs_hand"] < 1.1
    assert "route() / hand instr" in out.with_suffix(".md").read_text()
