"""The README's Python example runs, and the README shows it verbatim."""
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_python_example_runs_and_is_in_the_readme():
    path = os.path.join(ROOT, "examples", "python_usage.py")
    with open(path) as f:
        example = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert example in f.read(), "README.md must contain examples/python_usage.py verbatim"
    result = subprocess.run([sys.executable, path], check=True, capture_output=True, text=True)
    lines = result.stdout.splitlines()
    assert float(lines[0].split(":")[1]) < 1e-5
    assert float(lines[1].split(":")[1]) < 1e-4
    assert lines[2] == "ndarray"
    assert lines[-2:] == ["torch.bfloat16", "torch.bfloat16"]


def test_transformers_example_runs_and_is_in_the_readme():
    path = os.path.join(ROOT, "examples", "transformers_usage.py")
    with open(path) as f:
        example = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert example in f.read(), "README.md must contain examples/transformers_usage.py verbatim"
    result = subprocess.run([sys.executable, path], check=True, capture_output=True, text=True)
    lines = result.stdout.splitlines()
    assert lines[0] == "generated: (2, 32)"
    assert float(lines[1].split(":")[1]) < 1e-4
