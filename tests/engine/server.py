"""Start and stop a real server through our launcher, for the engine tests (one at a time)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

STARTUP_TIMEOUT_S = float(os.environ.get("POOLED_RUNNER_TEST_STARTUP_TIMEOUT", "240"))


@dataclass
class Server:
    url: str
    log_path: Path
    process: subprocess.Popen[bytes]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(process: subprocess.Popen[bytes]) -> None:
    # SIGTERM to the main pid ends the whole tree (SGLang kills its children); escalate only if it hangs.
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def launched(args: list[str], log_path: Path, extra_env: dict[str, str] | None = None) -> Iterator[Server]:
    """Run `python -m pooled_runner.launch ARGS` on 127.0.0.1, wait for /health, yield, then stop it."""
    port = free_port()
    cmd = [sys.executable, "-m", "pooled_runner.launch", "--host", "127.0.0.1", "--port", str(port), *args]
    log_file = log_path.open("wb")
    env = {
        k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"
    }  # set by tests/conftest.py for kernels
    env.update(extra_env or {})
    process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}"
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}"
                )
            time.sleep(1)
        yield Server(url=url, log_path=log_path, process=process)
    finally:
        _stop(process)
        log_file.close()


def generate_ids(url: str, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy ids from SGLang's native /generate, ignoring EOS so every run has the same length."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    r = requests.post(url + "/generate", json=body, timeout=120)
    r.raise_for_status()
    return list(r.json()["output_ids"])
