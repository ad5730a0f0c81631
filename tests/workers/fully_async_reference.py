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


def generate(tr: RLTrainer, prompts: list[int], first_uid: int) -> list:
    """The step's groups as the rollout pool streams them (group uid first_uid + pos): rows, prompt_pos = pos."""
    params = roles.train_sampling_params(tr.cfg, seed=stream_seed(tr.cfg))
    rows = []
    with tr.rollout_session():
        stream = SampleStream(tr.rollout, params)
        stream.version = tr.step - 1
        tr.rollout.open_stream(params)
        for pos, p in enumerate(prompts):
            item = tr.train_set[p]
            stream.add(first_uid + pos, item, (response_budgets([item], params.max_new_tokens) or [None])[0])
        while not stream.drained():
            for uid, r in stream.step():
                r.prompt_pos = uid - first_uid
                rows.append(r)
        tr.rollout.close_stream()
    return rows


def step(tr: RLTrainer, t) -> tuple[dict, dict]:
    g = tr.cfg.data.train_batch_size
    prompts = [tr.sampler.next_batch(1)[0] for _ in range(g)]  # granted one at a time
    rows = generate(tr, prompts, first_uid=(tr.step - 1) * g)
    items = [tr.train_set[prompts[r.prompt_pos]] for r in rows]
    responses = [tr.tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in rows]
    scores, _ = tr.scorer.score([it["data_source"] for it in items], responses,
                                [it["ground_truth"] for it in items],
                                [it.get("extra_info") for it in items])
    set_rule_scores(rows, scores)
    compose(rows, items, OverlongShaping.from_config(tr.cfg))
    batch = tr.rows_to_batch(sorted(rows, key=lambda r: (r.prompt_pos, r.sample)), prompts)
    metrics = tr.train_on(batch, t)
    tr.sync_weights()  # w_k: what step k+1 samples with
    return batch, metrics


if __name__ == "__main__":
    run_reference(step)
