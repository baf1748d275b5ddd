"""The README's Python examples run, and the README shows them verbatim."""
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _run_readme_example(name, launcher=(), args=()):
    """Runs examples/<name> (under `launcher`, e.g. torchrun) after checking README.md contains it
    verbatim; its stdout lines."""
    path = os.path.join(ROOT, "examples", name)
    with open(path) as f:
        example = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert example in f.read(), f"README.md must contain examples/{name} verbatim"
    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))  # ranks on 127.0.0.1
    result = subprocess.run([sys.executable, *launcher, path, *args], check=True, capture_output=True, text=True,
                            timeout=300, env=env)
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


def test_ring_attention_example_runs_under_torchrun_and_is_in_the_readme():
    # torchrun is torch.distributed.run; 4 ranks on 127.0.0.1, a short sequence.
    launcher = ("-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", "29517")
    lines = _run_readme_example("ring_attention.py", launcher, ("--tokens", "1024"))
    assert lines[0] == "4 ranks, 1024 tokens, 256 per rank"
    assert float(lines[1].split(":")[1]) < 1e-5
    assert lines[2] == "dq shard: (1, 8, 256, 64)"
