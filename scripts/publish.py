"""Regenerate every published map and figure: calibrate, measure the quality gate, evaluate, time, and write
``hub_cards/*`` and ``benchmarks/results/*``. This is the only code that writes hub_cards/.

    python -m scripts.publish                      # everything (several hours on 2 CPU cores)
    python -m scripts.publish --only siblings      # one family: siblings (Qwen2.5-Coder 0.5B <-> 1.5B) or adapters
    python -m scripts.publish --only siblings --stages capture scaling   # some stages

Long stages resume: calibration checkpoints its statistics and every stage keeps what it produced under
``--workdir`` (runs/publish), so a run started again continues where it stopped. Figures are copied into the
cards and the README only from the results files the stages wrote (with their provenance).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from benchmarks import siblings
from benchmarks.common import RESULTS, ROOT, save, table
from peft_kvcache import KVMap
from peft_kvcache.config import CalibrationConfig

logger = logging.getLogger("publish")
HUB_CARDS = ROOT / "hub_cards"
SCALES = (8, 16, 32, 64, 128)  # calibration files of the data-scaling curve; the published maps use one of them
SIBLING_CONFIG = CalibrationConfig(top_k=2, max_length=512, chunks_per_text=1)


class Publisher:
    """The stages of one publish run; each keeps its output under ``workdir`` and is skipped when it is there."""

    def __init__(self, workdir: Path, scales: tuple[int, ...] = SCALES, progress: bool = True):
        self.workdir, self.scales, self.progress = workdir, scales, progress
        self._siblings = None

    # ----- siblings -----

    def sibling_models(self):
        if self._siblings is None:
            self._siblings = siblings.load_pair()
        return self._siblings

    def scale_folder(self, scale: int, direction: str) -> Path:
        return self.workdir / "siblings" / f"files-{scale}" / siblings.pair_name(direction)

    def capture(self) -> None:
        """One pass of both Qwen models over the first max(SCALES) calibration files; both directions fitted at
        every scale of the data-scaling curve (nested prefixes of the same files)."""
        if all(self.scale_folder(s, d).is_dir() for s in self.scales for d in siblings.DIRECTIONS):
            logger.info("capture: every scale is fitted already")
            return
        models, tokenizer = self.sibling_models()
        texts = siblings.calibration_texts(tokenizer, max(self.scales), SIBLING_CONFIG)
        vocab = models["small"].get_input_embeddings().weight.shape[0]

        def on_scale(scale, run):
            for direction in siblings.DIRECTIONS:
                folder = self.scale_folder(scale, direction)
                if not folder.is_dir():
                    siblings.fit_direction(run, direction, texts, scale, SIBLING_CONFIG, vocab).save_pretrained(
                        folder, chart=False)
                    logger.info("fitted %s on %d files", folder.name, scale)

        siblings.capture(models, texts, list(self.scales), SIBLING_CONFIG, on_scale,
                         checkpoint_root=self.workdir / "siblings" / "checkpoints", progress=self.progress)


STAGES = {"siblings": ("capture",), "adapters": ()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(STAGES), nargs="+", default=sorted(STAGES))
    parser.add_argument("--stages", nargs="+", default=None, help="run only these stages (default: all)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "publish")
    parser.add_argument("--scales", type=int, nargs="+", default=list(SCALES),
                        help="calibration files of the data-scaling curve (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    publisher = Publisher(args.workdir, tuple(args.scales), progress=not args.no_progress)
    for family in args.only:
        for stage in STAGES[family]:
            if args.stages is None or stage in args.stages:
                logger.info("== %s: %s", family, stage)
                getattr(publisher, stage)()


if __name__ == "__main__":
    main()
