"""The wire contract between gateway and worker: frames, request and stats records, block hashes
and grammar specs. Light: no torch; other Switchyard packages may import it.
"""

from worker.protocol.block_hash import HASH_ALGO as HASH_ALGO
from worker.protocol.block_hash import block_id as block_id
from worker.protocol.block_hash import block_ids as block_ids
from worker.protocol.block_hash import chain as chain
from worker.protocol.frames import *  # noqa: F401,F403 - the contract's one face
from worker.protocol.grammar_spec import GrammarError as GrammarError
from worker.protocol.grammar_spec import GrammarSpec as GrammarSpec
from worker.protocol.grammar_spec import json_object_spec as json_object_spec
from worker.protocol.grammar_spec import json_schema_spec as json_schema_spec
from worker.protocol.grammar_spec import tool_call_spec as tool_call_spec
from worker.protocol.transfer import *  # noqa: F401,F403 - disaggregated prefill's frames (decode <-> prefill worker)
