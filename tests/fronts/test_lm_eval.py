"""lm-evaluation-harness against the HTTP front: its `local-completions` model (the OpenAI completions API with
`echo` and `logprobs`) scores (context, continuation) pairs on a server started here on a random-weight model,
and its log-likelihoods equal transformers' on the same model, exported to a Hugging Face directory.

lm-eval runs in its own virtualenv, `.venv-lmeval` (`make lmeval-venv`), as a subprocess: through its Python
API, on requests listed here (no task, no dataset, nothing downloaded; its tokenizer is the exported
directory). Without that virtualenv the test is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import ROOT
from tests.fronts.server_harness import ServerThread, free_port, settings

LMEVAL_PYTHON = ROOT / ".venv-lmeval" / "bin" / "python"

pytestmark = pytest.mark.skipif(not LMEVAL_PYTHON.exists(),
                                reason=".venv-lmeval is absent: `make lmeval-venv` builds lm-evaluation-harness's")

PAIRS = [  # (context, continuation), as a multiple-choice task asks them
    ("ROMEO: But soft, what light", " through yonder window breaks"),
    ("ROMEO: But soft, what light", " is this"),
    ("To be, or not to be", ", that is the question"),
    ("Tomorrow, and tomorrow", ", and tomorrow"),
    ("Tomorrow, and tomorrow ", "creeps in this petty pace"),  # its trailing space moves to the continuation
    ("A", "B"),
]

# the subprocess: lm-eval's model on the server; prints each pair's (log-likelihood, is_greedy, context ids,
# continuation ids), the ids as lm-eval tokenized them
SCRIPT = """
import json, sys
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

url, tokenizer, pairs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
lm = LocalCompletionsAPI(base_url=url, model="tiny", tokenizer=tokenizer, max_length=128, batch_size=4,
                         num_concurrent=1, max_retries=1)
requests = [Instance(request_type="loglikelihood", doc={}, arguments=tuple(p), idx=i) for i, p in enumerate(pairs)]
results = lm.loglikelihood(requests, disable_tqdm=True)
print(json.dumps([[ll, greedy, *lm._encode_pair(*p)] for (ll, greedy), p in zip(results, pairs)]))
"""


def test_lm_eval_log_likelihoods_equal_transformers(lively_bundle, lively_model_dir, tmp_path):
    import torch
    import transformers

    from model.hf.export_hf import export_hf

    hf_dir = export_hf(lively_model_dir, tmp_path / "hf")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    with ServerThread(settings(lively_bundle, http_port=free_port())) as srv:
        done = subprocess.run([str(LMEVAL_PYTHON), "-c", SCRIPT, srv.http_url + "/v1/completions", str(hf_dir),
                               json.dumps(PAIRS)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    scored = json.loads(done.stdout.strip().splitlines()[-1])

    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    for ll, greedy, context, continuation in scored:
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids).logits[0].double(), dim=-1)
        rows = logprobs[len(context) - 1:-1]  # position i predicts token i + 1
        want = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
        assert ll == pytest.approx(want.sum().item(), abs=1e-3)
        assert greedy == bool((rows.argmax(dim=-1) == torch.tensor(continuation)).all())
    assert len({round(ll, 3) for ll, *_ in scored}) == len(PAIRS)  # each scored on its own
