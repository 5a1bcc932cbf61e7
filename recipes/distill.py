"""Knowledge distillation: a small student learns from a larger SFT teacher, chunk by chunk.

    python recipes/distill.py                        # teacher (trained first if absent), the
                                                     # distilled student, and the SFT student
    python recipes/distill.py --divergence jsd --beta 0.5 --temperature 2.0
    python recipes/distill.py --alpha 1.0            # soft targets only, no hard labels

The teacher (the recipes' "base" decoder, trained by `recipes/sft.py` on more demonstrations)
labels a transfer set of prompts with its greedy answers; the student (the "student" decoder,
a quarter of the teacher's parameters) learns on those sequences from the teacher's full
next-token distributions, computed by `tunelib.losses.fused_distillation_loss` from both
models' hidden states without any `[B, T, V]` logits, mixed with the cross-entropy of the
teacher's tokens. The same student trained by SFT alone on the demonstrations, for the same
number of steps, is the baseline.
"""

import sys
from pathlib import Path

import common
import jax
import optax
import sft
from flax import nnx

from tunelib import logprobs, losses
from tunelib.data import sft_dataset


def build_parser():
    p = common.parser(__doc__.splitlines()[0], steps=1000, batch_size=64, learning_rate=3e-3)
    p.add_argument(
        "--divergence", choices=["forward_kl", "reverse_kl", "jsd"], default="forward_kl"
    )
    p.add_argument("--beta", type=float, default=0.5, help="JSD's teacher weight")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--alpha", type=float, default=0.5,
        help="weight of the soft (teacher distribution) term; 1 - alpha on the hard labels",
    )  # fmt: skip
    p.add_argument(
        "--num-prompts", type=int, default=3000,
        help="transfer-set prompts the teacher labels for the student",
    )  # fmt: skip
    p.add_argument(
        "--teacher-demonstrations", type=int, default=6000,
        help="demonstrations the teacher is trained on, when it must be trained first",
    )  # fmt: skip
    p.add_argument(
        "--teacher-steps", type=int, default=2000,
        help="steps of the teacher's SFT when it must be trained first",
    )  # fmt: skip
    p.add_argument(
        "--teacher-dir",
        type=Path,
        default=None,
        help="the teacher model folder (default runs/teacher-seed<seed>/model)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the SFT-only student")
    return p


def ensure_teacher(args) -> Path:
    folder = args.teacher_dir or common.RUNS / f"teacher-seed{args.seed}" / "model"
    if not common.has_model(folder):
        print(f"no teacher at {folder}: training it first with recipes/sft.py", flush=True)
        flags = common.forward_flags(args, "seed", "num_heldout", "max_digits", "logprobs")
        demonstrations = ["--num-train", str(args.teacher_demonstrations)]
        demonstrations += ["--steps", str(args.teacher_steps)]
        sft.main([*flags, *demonstrations, "--model-size", "base", "--out", str(folder.parent)])
    return folder


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    teacher_folder = ensure_teacher(args)
    run = common.Run("distill", args)
    task = common.task(args, num_train=args.num_prompts)
    _, teacher_graphdef, teacher_params = common.load_model(teacher_folder)
    config = common.model_config(task.tokenizer, "student")
    graphdef, params = common.init_model(config, args.seed)

    # The transfer set: the teacher's own greedy answers to the prompts (where it gives one).
    answers = common.greedy_answers(teacher_graphdef, teacher_params, task, task.train)
    records = [
        {"prompt": r["prompt"], "completion": a}
        for r, a in zip(task.train, answers, strict=True)
        if a
    ]
    batches = iter(
        sft_dataset(
            records, task.tokenizer, max_length=task.max_length, batch_size=args.batch_size,
            seed=args.seed,
        )
    )  # fmt: skip
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.learning_rate, warmup_steps=max(1, args.steps // 20), decay_steps=args.steps
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
    )

    def loss_fn(params, batch):
        teacher = nnx.merge(teacher_graphdef, teacher_params)
        teacher_hidden = jax.lax.stop_gradient(
            teacher(batch["tokens"], attention_where=batch["attention_where"])
        )
        student = nnx.merge(graphdef, params)
        hidden = student(batch["tokens"], attention_where=batch["attention_where"])
        soft = losses.fused_distillation_loss(
            hidden, student.unembedding(), teacher_hidden, teacher.unembedding(),
            divergence=args.divergence, beta=args.beta, temperature=args.temperature,
            where=batch["where"],
        )  # fmt: skip
        hard = -logprobs.fused_token_logps(
            hidden, student.unembedding(), batch["targets"], where=batch["where"],
            implementation=args.logprobs,
        )  # fmt: skip
        per_token = args.alpha * soft + (1 - args.alpha) * hard
        mean = lambda x: losses.aggregate(x, mode="token_mean", where=batch["where"]).mean()  # noqa: E731
        return mean(per_token), {"soft": mean(soft), "hard": mean(hard)}

    @jax.jit
    def train_step(state, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, {"loss": loss, **metrics}

    def evaluate(params):
        return {"accuracy": common.accuracy(graphdef, params, task)}

    accuracy_before = evaluate(params)["accuracy"]
    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "rng": common.key_data(args.seed),
    }
    state = run.train(state=state, batches=batches, step_fn=train_step, evaluate=evaluate)
    common.save_model(run.folder / "model", config, state["params"])
    headline = {
        "seed": args.seed,
        "steps": args.steps,
        "divergence": args.divergence,
        "teacher_accuracy": common.accuracy(teacher_graphdef, teacher_params, task),
        "accuracy_before": accuracy_before,
        "accuracy_after": run.records()[-1]["accuracy"],
    }
    if not args.no_baseline:
        same = ("seed", "steps", "learning_rate", "batch_size", "num_train", "num_heldout",
                "max_digits", "eval_every", "logprobs")  # fmt: skip
        out = ["--model-size", "student", "--out", str(run.folder / "sft-student")]
        headline["sft_accuracy_after"] = sft.main(common.forward_flags(args, *same) + out)[
            "accuracy_after"
        ]
    return run.finish(headline)


if __name__ == "__main__":
    main(sys.argv[1:])
