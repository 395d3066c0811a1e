"""train.py with test probes, run through the deepspeed launcher like train.py itself:

    deepspeed tests/helpers/train_with_probes.py [--kill-after-deepspeed-save STEP] [--record-logits] <train.py args>

--kill-after-deepspeed-save STEP: every rank SIGKILLs itself once DeepSpeed has written its files for
    that step's checkpoint, after truncating them: a kill in the middle of a save, before `latest` moves.
--record-logits: after training, every rank runs the trained engine on a fixed batch; rank 0 writes the
    logits to <output dir>/engine_logits.pt, to compare with the exported hf/ folder.
"""
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed import DeepSpeedEngine

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import train  # noqa: E402

FIXED_BATCH = torch.arange(1, 65).reshape(2, 32) * 37 % 4000


def kill_after_deepspeed_save(step: int) -> None:
    save = DeepSpeedEngine.save_checkpoint

    def save_then_die(engine, save_dir, tag=None, **kwargs):
        result = save(engine, save_dir, tag=tag, **kwargs)
        if tag == f"global_step{step}":
            for path in (Path(save_dir) / tag).glob(f"*rank_{dist.get_rank()}_*.pt"):
                path.write_bytes(path.read_bytes()[:100])  # as if the kill came mid-write
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    DeepSpeedEngine.save_checkpoint = save_then_die


def record_logits() -> None:
    export = train.export_hf

    def export_and_record(engine, tokenizer, out_dir, dtype):
        export(engine, tokenizer, out_dir, dtype)
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=FIXED_BATCH.to(engine.device)).logits.float().cpu()
        if dist.get_rank() == 0:
            torch.save(logits, Path(out_dir).parent / "engine_logits.pt")

    train.export_hf = export_and_record


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--kill-after-deepspeed-save" in args:
        at = args.index("--kill-after-deepspeed-save")
        kill_after_deepspeed_save(int(args[at + 1]))
        del args[at:at + 2]
    if "--record-logits" in args:
        args.remove("--record-logits")
        record_logits()
    sys.exit(train.main(args))
