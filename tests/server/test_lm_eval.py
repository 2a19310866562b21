"""lm-eval's ``local-completions`` model runs a small multiple-choice task end to end against the
server: it finds the server's tokenizer endpoints, sends batches of token-id prompts with
``echo`` and ``logprobs``, and scores each choice by the log-probabilities of its tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import gemma

pytestmark = pytest.mark.model  # loads the embedded Gemma 3 270M

gemma.require_model()
pytest.importorskip("fastapi")
lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("The capital of Germany is", ["Paris", "Berlin", "Madrid", "Rome"], 1),
    ("The capital of Spain is", ["Paris", "Berlin", "Madrid", "Rome"], 2),
    ("The capital of Italy is", ["Paris", "Berlin", "Madrid", "Rome"], 3),
    ("The capital of Japan is", ["Tokyo", "Cairo", "Lima", "Oslo"], 0),
    ("The capital of Egypt is", ["Tokyo", "Cairo", "Lima", "Oslo"], 1),
    ("The capital of Peru is", ["Tokyo", "Cairo", "Lima", "Oslo"], 2),
    ("The capital of Norway is", ["Tokyo", "Cairo", "Lima", "Oslo"], 3),
]
TASK = """\
task: capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def reference_loglikelihood(context: str, continuation: str) -> float:
    """log P(continuation | <bos> context) from the engine's own logits, split as lm-eval splits it."""
    import torch

    from hybridkv.engine.engine import EngineConfig, LLMEngine
    from hybridkv.engine.sampling import SamplingParams

    tok = gemma.tokenizer()
    whole = tok.encode(context + continuation, add_bos=False)
    cont = whole[len(tok.encode(context, add_bos=False)):]
    ids = [tok.bos_token_id, *whole]
    eng = LLMEngine(gemma.weights(), tok, EngineConfig(dtype="float32", max_model_len=128,
                                                       kv_cache_memory=16 << 20))
    rows: list[Any] = []
    eng.add_request("ref", ids, SamplingParams(max_tokens=1), logits_sink=lambda _p, lg: rows.append(lg))
    while eng.has_unfinished:
        eng.step()
    logprobs = torch.log_softmax(torch.cat(rows), -1)
    first = len(ids) - len(cont)
    return sum(logprobs[p - 1, ids[p]].item() for p in range(first, len(ids)))


def test_lm_eval_multiple_choice_task_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "capitals.yaml").write_text(TASK.format(data=data))
    url = gemma.server_url()
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["capitals"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args=f"base_url={url}/v1/completions,model={gemma.MODEL_NAME},num_concurrent=1,max_retries=1",
        batch_size=4, log_samples=True)
    assert results is not None
    print(results["results"]["capitals"])
    assert results["results"]["capitals"]["acc,none"] >= 0.75  # 4 choices: chance is 0.25
    sample = results["samples"]["capitals"][0]
    (context, paris), (_, berlin) = sample["arguments"][:2]
    (ll_paris, _), (ll_berlin, _) = sample["resps"][0][0], sample["resps"][1][0]
    assert ll_paris == pytest.approx(reference_loglikelihood(context, paris), abs=2e-3)
    assert ll_berlin == pytest.approx(reference_loglikelihood(context, berlin), abs=2e-3)
    assert ll_paris > ll_berlin
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # nothing was fetched: the tokenizer came from the server
