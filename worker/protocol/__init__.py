"""The wire contract between gateway and worker: frames, request and stats records, registration, block
hashes and grammar specs. Light: no torch; other Switchyard packages may import it.
"""

from worker.protocol.frames import *  # noqa: F401,F403 - the contract's one face
