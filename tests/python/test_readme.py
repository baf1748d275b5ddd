"""The README's Python examples run, and the README shows them verbatim."""
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _run_readme_example(name):
    """Runs examples/<name> after checking README.md contains it verbatim; its stdout lines."""
    path = os.path.join(ROOT, "examples", name)
    with open(path) as f:
        example = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert example in f.read(), f"README.md must contain examples/{name} verbatim"
    result = subprocess.run([sys.executable, path], check=True, capture_output=True, text=True)
    return result.stdout.splitlines()


def test_python_example_runs_and_is_in_the_readme():
    lines = _run_readme_example("python_usage.py")
    assert float(lines[0].split(":")[1]) < 1e-5
    assert float(lines[1].split(":")[1]) < 1e-4
    assert lines[2] == "ndarray"
    assert lines[-2:] == ["torch.bfloat16", "torch.bfloat16"]


def test_transformers_example_runs_and_is_in_the_readme():
    lines = _run_readme_example("transformers_usage.py")
    assert lines[0] == "generated: (2, 32)"
    assert float(lines[1].split(":")[1]) < 1e-4
