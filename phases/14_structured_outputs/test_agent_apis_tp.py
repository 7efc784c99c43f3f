"""The Responses and Messages APIs under torchrun (float32 on ``tp_device``): rank 0 serves them, the
other ranks mirror its steps, and each answers the greedy text a single process gives (HF
transformers' greedy tokens on the prompt the chat template renders)."""
import importlib

import pytest
import torch
import torch.distributed as dist

from engine.core.llm_engine import LLMEngine
from test_agent_server import make_agent_checkpoint

server_cases = importlib.import_module("phases.10_e2e_acceptance.server_cases")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.torchrun
MESSAGES = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Which city?"}]
MAX_TOKENS = 12


def test_tp_server_answers_responses_and_messages_with_the_single_process_text(tp_group, tp_device,
                                                                               tmp_path_factory):
    assert tp_group.size > 1
    path = [make_agent_checkpoint(tmp_path_factory.mktemp("agent-tp")) if tp_group.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    engine = LLMEngine(path[0], block_size=4, max_num_seqs=8, max_model_len=512, device=tp_device, dtype="float32")
    if tp_group.rank != 0:
        server_cases.mirror_until_stopped(engine)
        return
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path[0]), dtype=torch.float32).eval()
    prompt = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([engine.tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=0, pad_token_id=0)
    expected = engine.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    with server_cases.running_server(engine, tool_call_parser="hermes") as running:
        with openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0) as client:
            response = client.responses.create(model="tiny", instructions=MESSAGES[0]["content"],
                                               input=MESSAGES[1]["content"], max_output_tokens=MAX_TOKENS,
                                               temperature=0)
        with anthropic.Anthropic(base_url=running.url, api_key="none", max_retries=0) as claude:
            message = claude.messages.create(model="tiny", system=MESSAGES[0]["content"], max_tokens=MAX_TOKENS,
                                             messages=[MESSAGES[1]], extra_body={"temperature": 0})
        server_cases.wait_idle(running.engine_client)
    assert response.output_text == expected
    assert "".join(b.text for b in message.content) == expected
