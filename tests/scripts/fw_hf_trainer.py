"""A Hugging Face `Trainer` run for the framework tests: a tiny GPT-2 built
from a config (no download), random tokens, HfArgumentParser flags.

    python fw_hf_trainer.py --per_device_train_batch_size 16   # OOMs under oomdoc on 24MiB
    python fw_hf_trainer.py --per_device_train_batch_size 16 --activation_checkpointing

Everything that would print, log, save or spawn is off: no reports, no
checkpoints, no progress bar, no dataloader workers, the CPU only.
"""

import os
import tempfile
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging


@dataclass
class ModelArguments:
    n_layer: int = field(default=2, metadata={"help": "transformer blocks"})
    n_embd: int = field(default=64, metadata={"help": "width"})
    seq_len: int = field(default=64, metadata={"help": "tokens per sample"})
    vocab_size: int = field(default=512, metadata={"help": "vocabulary"})
    eval_samples: int = field(default=0, metadata={"help": "an evaluation set of this size"})
    metrics: bool = field(default=False, metadata={"help": "compute_metrics (keeps predictions)"})


class RandomTokens(Dataset):
    """A small fixed pool of random token sequences (the simulated device
    counts the dataset, so it does not grow with the batch size)."""

    POOL = 64

    def __init__(self, length, seq_len, vocab_size):
        self.length = length
        generator = torch.Generator().manual_seed(0)
        self.pool = torch.randint(0, vocab_size, (self.POOL, seq_len), generator=generator)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        tokens = self.pool[index % self.POOL]
        return {"input_ids": tokens, "labels": tokens}


def main():
    hf_logging.set_verbosity_error()
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    parser.set_defaults(
        output_dir=os.path.join(tempfile.gettempdir(), "oomdoc-fw-hf-trainer"),
        max_steps=3,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
    )
    model_args, training_args = parser.parse_args_into_dataclasses()
    # Tiny ops: one thread is much faster than two contending ones on a busy CI machine.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=model_args.vocab_size,
        n_positions=model_args.seq_len,
        n_embd=model_args.n_embd,
        n_layer=model_args.n_layer,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    # Enough samples for max_steps optimizer steps of full accumulation cycles.
    samples = (
        training_args.max_steps
        * training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
    )
    data = RandomTokens(samples, model_args.seq_len, model_args.vocab_size)
    extra = {}
    if model_args.eval_samples:
        extra["eval_dataset"] = RandomTokens(
            model_args.eval_samples, model_args.seq_len, model_args.vocab_size
        )
    if model_args.metrics:
        # Trainer then gathers every evaluation batch's logits (on the
        # device unless eval_accumulation_steps moves them to the CPU).
        extra["compute_metrics"] = lambda prediction: {"logits": float(prediction.predictions.size)}
    trainer = Trainer(model=model, args=training_args, train_dataset=data, **extra)
    result = trainer.train()
    print(f"trained {result.global_step} steps, loss {result.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
