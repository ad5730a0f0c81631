"""The synchronous reference of the fully asynchronous trainer at async_training.staleness_threshold=0 without partial
rollout, built from the synchronous trainer's parts in one process. There the grant limit hands out exactly one
step's prompts at a time, after the weights of the step before were pushed, so every group is sampled by the policy
that trains on it: step k draws its prompts one at a time (as the coordinator grants them; group uid (k-1)*B + i),
the rollout streams them with the fully asynchronous seed, each sample's random stream keyed by (uid, sample) as
the rollout pool's stream keys it (`SampleStream`), the rule reward scores each sample, then the synchronous
trainer's forward passes, advantages, update and weight sync.

Usage: python fully_async_reference.py key=value ...   (the synchronous run's arguments)
"""
from worker_common import run_reference

from rlhf_mcore.rewards.pipeline import OverlongShaping, compose, set_rule_scores
from rlhf_mcore.trainer import roles
from rlhf_mcore.trainer.rl_trainer import RLTrainer
from rlhf_mcore.trainer.rollout_phase import response_budgets
from rlhf_mcore.trainer.rollout_worker import stream_seed
from rlhf_mcore.trainer.sample_streams import SampleStream
from rlhf_mcore.trainer.step_batch import rows_to_batch


def generate(tr: RLTrainer, prompts: list[int], first_uid: int) -> list:
    """The step's groups as the rollout pool streams them (group uid first_uid + pos): rows, prompt_pos = pos."""
    run, engine = tr.run, tr.rollout.engine
    params = roles.train_sampling_params(run.cfg, seed=stream_seed(run.cfg))
    rows = []
    with tr.rollout.session():
        stream = SampleStream(engine, params)
        stream.version = run.step - 1
        engine.open_stream(params)
        for pos, p in enumerate(prompts):
            item = run.train_set[p]
            stream.add(first_uid + pos, item, (response_budgets([item], params.max_new_tokens) or [None])[0])
        while not stream.drained():
            for uid, r in stream.step():
                r.prompt_pos = uid - first_uid
                rows.append(r)
        engine.close_stream()
    return rows


def step(tr: RLTrainer, t) -> tuple[dict, dict]:
    run = tr.run
    g = run.cfg.data.train_batch_size
    prompts = [run.draw(1)[0] for _ in range(g)]  # granted one at a time
    rows = generate(tr, prompts, first_uid=(run.step - 1) * g)
    items = [run.train_set[prompts[r.prompt_pos]] for r in rows]
    responses = [run.tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in rows]
    scores, _ = run.scorer.score([it["data_source"] for it in items], responses,
                                [it["ground_truth"] for it in items],
                                [it.get("extra_info") for it in items])
    set_rule_scores(rows, scores)
    compose(rows, items, OverlongShaping.from_config(run.cfg))
    batch = rows_to_batch(sorted(rows, key=lambda r: (r.prompt_pos, r.sample)), prompts, run.train_set,
                          run.tokenizer.pad_token_id)
    metrics = tr.learner.train_on(batch, t)
    tr.rollout.sync_weights()  # w_k: what step k+1 samples with
    return batch, metrics


if __name__ == "__main__":
    run_reference(step)
