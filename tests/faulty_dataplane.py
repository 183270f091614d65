"""Test-only data plane whose runner fails every step that starts a "poisoned" prompt.

Run it like the CLI: ``python tests/faulty_dataplane.py dataplane --model ... --listen ...``.
A prompt whose first token is POISON_TOKEN makes its first step raise, so the data
plane answers that step with an error result, as it would after a real fault.
The first step that starts a prompt whose first token is SLOW_TOKEN takes SLOW_SECONDS
more (once per process): a data plane that still answers keepalive pings, but not the step.
Every step that starts a prompt whose first token is PAUSE_TOKEN takes PAUSE_SECONDS more, time for
requests sent meanwhile to queue up; it first creates the file that PAUSE_MARK (an environment
variable) names, if set, so a test knows the pause has begun.
No hook of this kind lives in the product code: this script swaps the runner class.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

POISON_TOKEN = 48999
SLOW_TOKEN, SLOW_SECONDS = 48998, 8.0
PAUSE_TOKEN, PAUSE_SECONDS, PAUSE_MARK = 48997, 1.5, "TWINPLANE_TEST_PAUSE_MARK"


def install() -> None:
    from twinplane.dataplane import model_runner

    slowed = []

    class FaultyRunner(model_runner.ModelRunner):
        def launch(self, plan, keep_logits=False):
            cols = plan.cols()
            firsts = np.concatenate([[0], np.cumsum(cols.num_tokens)[:-1]]).astype(int)
            for seq_id, start, first in zip(cols.seq_ids.tolist(), cols.start_pos.tolist(), firsts.tolist()):
                first_token = int(cols.token_ids[first])
                if seq_id in cols.inits and start == 0 and first_token == POISON_TOKEN:
                    raise RuntimeError(f"injected fault in step {plan.step_id} (seq {seq_id})")
                if start == 0 and first_token == SLOW_TOKEN and not slowed:
                    slowed.append(plan.step_id)
                    time.sleep(SLOW_SECONDS)
                if start == 0 and first_token == PAUSE_TOKEN:
                    if os.environ.get(PAUSE_MARK):
                        Path(os.environ[PAUSE_MARK]).touch()
                    time.sleep(PAUSE_SECONDS)
            return super().launch(plan, keep_logits)

    model_runner.ModelRunner = FaultyRunner  # dataplane.main imports it when serving starts


if __name__ == "__main__":
    install()
    from twinplane.clients.cli import main

    sys.exit(main())
