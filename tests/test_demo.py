"""The demo bootstrap: idempotent, and the autoscaled model is left to the control loop."""

from django.core.management import call_command

from fleet.assignments import assignment_for
from fleet.models import Deployment, Node
from registry.models import Model
from tests.factories import make_session

# Not marked `backends`: training does not depend on the database, and bootstrap_demo runs on the
# embedded default in tests/e2e/test_docs_examples.py (as `make up` runs it).


def test_bootstrap_demo_twice_sets_up_an_autoscaled_deployment(db, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_DEMO_TEXT_SECONDS", "1")
    monkeypatch.setenv("SWITCHYARD_DEMO_LLAMA_SECONDS", "1")
    call_command("bootstrap_demo", stdout=open("/dev/null", "w"))
    call_command("bootstrap_demo", stdout=open("/dev/null", "w"))
    deployment = Deployment.objects.get()
    assert (deployment.pool.name, deployment.pool.backend) == ("local", "local")
    assert deployment.version.model.name == "fraud-autoscaled"
    assert (deployment.min_replicas, deployment.max_replicas) == (0, 3)
    # The demo's hand-run agent serves the other models; replicas serve the deployed one.
    node = Node.objects.get(name="local")
    served = {s.model for s in assignment_for(node, make_session(node).pk)}
    assert served == {"fraud-detector", "storyteller", "llama-storyteller", "minilm"}
    assert Model.objects.get(name="llama-storyteller").versions.get().format == "hf"
    assert Model.objects.count() == 5
    minilm = Model.objects.get(name="minilm")
    assert minilm.task == "embedding" and minilm.versions.get().tokenizer_sha256
