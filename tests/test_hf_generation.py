"""The gateway's side of ``hf`` versions: chats go to the agent as messages (it renders the
model's own template), and prompts are counted by the agent's tokenizer, not as bytes."""

import pytest
from django.core.files.base import ContentFile

from registry.models import ArtifactFormat, ModelVersion
from registry.services import TEXTGEN_INPUTS, TEXTGEN_OUTPUTS, set_alias
from serving_agent.protocol import ChatTurn
from tests.factories import make_model
from tests.test_generation import FakeAgent, openai_post, run, state  # noqa: F401 - fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.backends]


@pytest.fixture
def llm(world):
    model = make_model(world.a, "llm", task="generator")
    version = ModelVersion(
        model=model,
        version=1,
        sha256="1" * 64,
        format=ArtifactFormat.HF,
        inputs=TEXTGEN_INPUTS,
        outputs=TEXTGEN_OUTPUTS,
        max_input_tokens=8,
        max_output_tokens=64,
    )
    version.artifact.save(f"{version.sha256}.hf", ContentFile(b"archive"), save=False)
    version.save()
    set_alias(model, "production", version)
    world.version = version
    return world


def test_an_hf_version_generates_text(llm):
    assert llm.version.generates_text


def test_a_chat_goes_to_the_agent_as_messages_without_the_plain_formats_stop(llm, state):  # noqa: F811
    async def scenario():
        agent = FakeAgent(state(), llm.version.pk)
        body = {
            "model": "llm",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            "max_tokens": 30,
            "stop": "END",
            "top_k": 5,
        }
        answer = await openai_post(llm.key_a, "/v1/chat/completions", body)()
        return agent, answer

    agent, (response, answer) = run(scenario)
    assert response.status_code == 200, answer
    sent = agent.requests[0]
    assert sent.messages == [ChatTurn("system", "Be brief."), ChatTurn("user", "Hi")]
    assert sent.stop == ["END"]  # the model's template and EOS end its turn
    assert sent.top_k == 5
    # Usage is the agent's count (the fake counts characters of the prompt it got).
    assert answer["usage"]["prompt_tokens"] == len(sent.prompt)


def test_the_prompt_limit_is_left_to_the_agents_tokenizer(llm, state):  # noqa: F811
    """Longer than max_input_tokens in bytes, so refused for the byte model; an hf version's
    agent counts the model's tokens (and refuses past the limit itself)."""

    async def scenario():
        FakeAgent(state(), llm.version.pk)
        body = {"model": "llm", "prompt": "a prompt of many bytes", "max_tokens": 4}
        return await openai_post(llm.key_a, "/v1/completions", body)()

    response, answer = run(scenario)
    assert response.status_code == 200, answer
    assert answer["usage"]["prompt_tokens"] == len("a prompt of many bytes")
