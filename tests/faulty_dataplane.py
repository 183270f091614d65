"""Test-only data plane whose runner fails every step that starts a "poisoned" prompt.

Run it like the CLI: ``python tests/faulty_dataplane.py dataplane --model ... --listen ...``.
A prompt whose first token is POISON_TOKEN makes its first step raise, so the data
plane answers that step with an error result, as it would after a real fault.
No hook of this kind lives in the product code: this script swaps the runner class.
"""

from __future__ import annotations

import sys

POISON_TOKEN = 48999


def install() -> None:
    from twinplane.dataplane import model_runner

    class FaultyRunner(model_runner.ModelRunner):
        def step(self, plan):
            for seq in plan.seqs:
                if seq.init is not None and seq.start_pos == 0 and int(seq.token_ids[0]) == POISON_TOKEN:
                    raise RuntimeError(f"injected fault in step {plan.step_id} (seq {seq.seq_id})")
            return super().step(plan)

    model_runner.ModelRunner = FaultyRunner  # dataplane.main imports it when serving starts


if __name__ == "__main__":
    install()
    from twinplane.clients.cli import main

    sys.exit(main())
