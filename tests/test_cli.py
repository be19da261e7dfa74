"""The tread-fx command: formats, colour, output files and clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tread_fx import cli
from tread_fx.inspection.report import SCHEMA

TINY = json.dumps(
    {
        "input_size": 8,
        "in_channels": 1,
        "depth": 4,
        "hidden_size": 32,
        "num_heads": 2,
        "num_classes": 10,
    }
)
DIT = ["tread_fx.models:DiT_S_2", "--model-kwargs", TINY, "--routes", "1:3"]


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_text_is_plain_when_piped(capsys):
    code, out, _ = _run(capsys, "explain", *DIT)
    assert code == 0
    assert "blocks: 4 x DiTBlock" in out and "16 -> 8 tokens" in out and "gather_tokens" in out
    assert "Predicted speed-up" in out and "\033[" not in out


def test_explain_text_is_coloured_when_asked(capsys):
    code, out, _ = _run(capsys, "explain", *DIT, "--color", "always", "--no-flops")
    assert code == 0 and "\033[1m" in out and "not counted" in out


def test_explain_json_follows_the_schema(capsys):
    from test_explain import _validate

    code, out, _ = _run(capsys, "explain", *DIT, "--format", "json", "--kwargs", TINY)
    assert code == 0
    data = json.loads(out)
    _validate(data, SCHEMA)
    assert data["routes"][0]["kept_tokens"] == 8 and data["flops"]["speedup"] > 1


def test_diff_text_json_and_dot(capsys, tmp_path):
    code, out, _ = _run(capsys, "diff", *DIT)
    assert code == 0 and "added 4" in out and "+ gather_tokens" in out
    code, out, _ = _run(capsys, "diff", *DIT, "--format", "json")
    data = json.loads(out)
    assert data["schema"] == "tread_fx.diff/1" and data["counts"]["added"] == 4
    path = tmp_path / "g.dot"
    code, out, err = _run(capsys, "diff", *DIT, "--format", "dot", "--out", str(path))
    assert code == 0 and out == "" and str(path) in err
    assert path.read_text().startswith("digraph") and "routed:scatter_tokens" in path.read_text()


def test_html_is_one_self_contained_file(capsys, tmp_path):
    path = tmp_path / "report.html"
    code, _, _ = _run(capsys, "explain", *DIT, "--format", "html", "--out", str(path))
    page = path.read_text()
    assert code == 0 and page.startswith("<!DOCTYPE html>")
    assert 'data-role="gather"' in page and 'id="routed-scatter_tokens"' in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_svg_without_graphviz_says_so(capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code, out, err = _run(capsys, "diff", *DIT, "--format", "svg")
    assert code == 1 and out == ""
    assert "Graphviz" in err and "apt-get install graphviz" in err and "--format dot" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "DiT_B_2"], "package.module:factory"),
        (["explain", "tread_fx.models:DiT_B_3"], "Did you mean"),
        (["explain", "no_such_package_xyz:make"], "cannot be imported"),
        (["explain", "tread_fx.models:DiT_S_2", "--routes", "2-9"], "START:END"),
        (["explain", "tread_fx.models:DiT_S_2", "--kwargs", "{depth: 4}"], "not valid JSON"),
        (["explain", "tread_fx.models:DiT_S_2", "--kwargs", '{"depht": 4}'], "rejected"),
        (["explain", "tread_fx.models:DiT_S_2", "--input-shape", "1,a"], "not a shape"),
        (["explain", "tread_fx.models:__name__"], "not a factory"),
        ([*["explain", *DIT[:3]], "--routes", "1:9"], "route"),
    ],
)
def test_bad_requests_get_a_clear_error_and_exit_1(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 1 and out == ""
    assert err.startswith("tread-fx: error: ") and message in err


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "user_models_for_cli.py").write_text(
        textwrap.dedent("""
        import random

        import torch
        from torch import nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                return x + self.lin(x)

        class DataDependent(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(Block() for _ in range(4))

            def forward(self, x):
                if random.random() < 0.5:  # Python randomness: never baked into a graph
                    x = -x
                for block in self.blocks:
                    x = block(x)
                return x

        class Plain(DataDependent):
            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x

        def make_plain():
            return Plain()
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_untraceable_model_gets_a_clear_error(capsys, user_models):
    code, _, err = _run(
        capsys,
        "explain",
        "user_models_for_cli:DataDependent",
        "--input-shape",
        "2,16,8",
        "--routes",
        "1:3",
    )
    assert code == 1 and "cannot trace DataDependent.forward" in err and "random" in err


def test_any_factory_with_an_input_shape(capsys, user_models):
    code, out, _ = _run(
        capsys,
        "explain",
        "user_models_for_cli:make_plain",
        "--input-shape",
        "2,16,8",
        "--routes",
        "1:3",
    )
    assert code == 0 and "blocks: 4 x Block" in out and "16 -> 8 tokens" in out
    code, _, err = _run(capsys, "explain", "user_models_for_cli:make_plain", "--routes", "1:3")
    assert code == 1 and "--input-shape" in err
    code, _, err = _run(
        capsys,
        "explain",
        "user_models_for_cli:make_plain",
        "--input-shape",
        "2,16,5",
        "--routes",
        "1:3",
    )
    assert code == 1 and "failed while being traced" in err


def test_the_console_script_runs():
    exe = shutil.which("tread-fx", path=os.path.dirname(sys.executable))
    command = [exe] if exe else [sys.executable, "-m", "tread_fx.cli"]
    result = subprocess.run(
        [*command, "diff", *DIT], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "+ select_random" in result.stdout
    bad = subprocess.run(
        [*command, "diff", "nope"], capture_output=True, text=True, timeout=300, check=False
    )
    assert bad.returncode == 1 and "tread-fx: error:" in bad.stderr


def test_help_and_bad_command_lines_do_not_import_torch():
    """``tread-fx --help`` parses before anything heavy is imported (the console script calls
    ``tread_fx.cli:main``)."""
    probe = textwrap.dedent(
        """
        import sys
        from tread_fx.cli import main
        for argv in (["--help"], ["explain", "--help"], ["explain"]):
            try:
                main(argv)
            except SystemExit:
                pass
        print("torch" in sys.modules, "tread_fx.api" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert "usage: tread-fx" in done.stdout
    assert done.stdout.splitlines()[-1].split() == ["False", "False"], done.stdout + done.stderr


def test_out_creates_its_folder(capsys, tmp_path):
    path = tmp_path / "runs" / "explain" / "dit.txt"
    code, out, err = _run(capsys, "explain", *DIT, "--no-flops", "--out", str(path))
    assert code == 0 and not out and "blocks: 4 x DiTBlock" in path.read_text()
