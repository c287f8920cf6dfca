import sys
sys.path.insert(0, "/work/main")
from bench.common import loaded, ONE_NODE
from store.models import *
from store import RunStatus
from store.timeutil import utcnow
from engine.local import new_run_id
lw = loaded(ONE_NODE)
def mk():
    now = utcnow()
    return RunDocument(run_id=new_run_id(), tenant="default", origin=Origin.FLEET,
        workflow=WorkflowRef(name=lw.workflow.name, source=lw.source, source_hash=lw.source_hash),
        inputs={}, budget=lw.workflow.budget.to_store(), status=RunStatus.QUEUED, attachments=[],
        attempt=1, attempt_at=now, created_at=now, updated_at=now)
