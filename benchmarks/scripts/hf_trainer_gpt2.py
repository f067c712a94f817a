"""A Hugging Face `Trainer` run of a GPT-2 built from a config (no downloads).

    python hf_trainer_gpt2.py --preset tiny --per_device_train_batch_size 8 --max_steps 20
    python hf_trainer_gpt2.py --preset medium --per_device_train_batch_size 8   # GPU

Random token sequences, AdamW, no checkpoints and no logging integrations.
Prints `step N: loss L (T ms, cpu C ms)` per optimizer step (the step's wall
time and the process's CPU time), from a TrainerCallback; on CUDA the step
time is taken after a synchronize, so it is the step's, not its launch's.
"""

import argparse
import os
import tempfile
import time

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

PRESETS = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=1024),
    "small": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024, vocab_size=50257),
}


class RandomTokens(Dataset):
    def __init__(self, length, seq_len, vocab):
        self.length, self.seq_len, self.vocab = length, seq_len, vocab

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        tokens = torch.randint(0, self.vocab, (self.seq_len,), generator=generator)
        return {"input_ids": tokens, "labels": tokens.clone()}


class StepTimes(TrainerCallback):
    """Prints each optimizer step's wall and CPU time."""

    def __init__(self):
        self.last = self.last_cpu = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.last is None:
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now, now_cpu = time.perf_counter(), time.process_time()
        loss = state.log_history[-1]["loss"] if state.log_history else float("nan")
        print(
            f"step {state.global_step - 1}: loss {loss:.4f} ({1000 * (now - self.last):.3f} ms, "
            f"cpu {1000 * (now_cpu - self.last_cpu):.3f} ms)",
            flush=True,
        )
        self.last, self.last_cpu = now, now_cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's context")
    args = parser.parse_args()

    config = GPT2Config(**PRESETS[args.preset])
    seq_len = args.seq_len or config.n_positions
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    data = RandomTokens(
        args.max_steps * args.per_device_train_batch_size, seq_len, config.vocab_size
    )
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=args.per_device_train_batch_size,
            max_steps=args.max_steps,
            learning_rate=3e-4,
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[StepTimes()])
        trainer.train()
    if not os.environ.get("OOMDOC_REPLAY"):
        print("done", flush=True)


if __name__ == "__main__":
    main()
