"""A process that exits while its AsyncEngine is mid-generation ends cleanly.

The engine loop is a daemon thread. Left stepping when the interpreter tears down, it is inside
a torch op while libtorch's static destructors run, and the process aborts ("terminate called
without an active exception", exit 134) after its work is done: a replica stopped with requests
in flight, a script that never shut its engine down, or a test session that left one running.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, tempfile, time

    from deployments.frontend.engine.async_engine import AsyncEngine
    from deployments.frontend.engine.engine_commands import AddRequest, Stream
    from shortconv.llm import build_engine
    from shortconv.sampling.sampling_params import SamplingParams
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(
        "lfm2", tempfile.mkdtemp(), {"hidden_size": 256, "intermediate_size": 512},
        with_tokenizer=False,
    )
    eng = AsyncEngine(build_engine(ckpt, dtype="float32"), admission_limit=4)
    eng.start()
    # A request nobody consumes or aborts: the loop keeps stepping until the process exits.
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    stream = Stream(asyncio.new_event_loop(), asyncio.Queue(), None)
    eng._cmds.put(AddRequest("r0", [1, 2, 3, 4], params, stream))
    while eng.engine._counts["generation"] < 3:  # a few tokens decoded: it is stepping
        time.sleep(0.05)
    print("stepping at exit", flush=True)
    """
)


def test_exit_while_the_engine_loop_is_stepping_is_clean(tmp_path: Path) -> None:
    script = tmp_path / "exit_mid_step.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "stepping at exit" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
