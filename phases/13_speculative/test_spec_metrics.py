"""Speculative decoding's counters on the server's /metrics, labelled with the method: verify
entries that drafted, tokens drafted and accepted (per core and in total), and the drafts
accepted at each draft position — which can only fall from one position to the next and sum to
the accepted tokens."""
import importlib

from engine.core.llm_engine import LLMEngine
from engine.entrypoints.bench.spec import plain_workload

server_cases = importlib.import_module("phases.10_e2e_acceptance.server_cases")


def test_metrics_count_drafts_per_method_and_position():
    engine = LLMEngine(speculative="eagle3", num_speculative_tokens=4, max_num_seqs=2)
    with server_cases.running_server(engine) as served:
        for prompt, _ in plain_workload()[:2]:
            status, raw = server_cases.http(served.url + "/v1/completions",
                                            {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0})
            assert status == 200, raw
        server_cases.wait_idle(served.engine_client)
        values = server_cases.metrics(served.url)
    method = "method=eagle3"
    drafts = values[f"agent_infer:spec_decode_num_drafts_total{{{method}}}"]
    drafted = values[f"agent_infer:spec_decode_num_draft_tokens_total{{{method}}}"]
    accepted = values[f"agent_infer:spec_decode_num_accepted_tokens_total{{{method}}}"]
    assert values[f"agent_infer:spec_decode_num_draft_tokens_total{{core=0,{method}}}"] == drafted
    per_position = [values[f"agent_infer:spec_decode_num_accepted_tokens_per_pos_total{{{method},position={j}}}"]
                    for j in range(4)]
    assert 0 < accepted < drafted <= 4 * drafts
    assert sum(per_position) == accepted
    assert drafts >= per_position[0] and all(a >= b for a, b in zip(per_position, per_position[1:]))
    assert engine.scheduler.num_accepted_tokens == accepted
