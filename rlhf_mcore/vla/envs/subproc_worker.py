"""One env worker of :class:`rlhf_mcore.vla.envs.subproc.SubprocVectorEnv`: `python -m
rlhf_mcore.vla.envs.subproc_worker FD PARENT_PID`, FD a socket to the parent. The protocol, in order: the parent's
`sys.path`; `(env_fn, num_envs)`; this worker answers `("ok", (spec, bytes))` and sends the descriptor of its shared
block (a memfd); then commands `("reset", state_ids)` -> `("ok", instructions)`, `("step", actions)` ->
`("ok", (reward, terminated, truncated, info, seconds stepping))`, `("close", None)`; a failure answers
`("error", traceback)` and exits."""
from __future__ import annotations

import mmap
import os
import socket
import sys
import time
import traceback


def main(fd: int, parent: int) -> None:
    from rlhf_mcore.lifetime import die_with_parent

    die_with_parent(parent)  # first: a SIGKILLed parent takes this worker along
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    sys.path[:] = conn.recv()
    try:
        env_fn, num_envs = conn.recv()
        env = env_fn(num_envs=num_envs)
        from rlhf_mcore.vla.envs.subproc import _views, obs_layout

        layout, size = obs_layout(env.spec, num_envs)
        mfd = os.memfd_create("rlhf_mcore_vla_obs")
        os.ftruncate(mfd, size)
        block = mmap.mmap(mfd, size)
        views = _views(block, layout)
        conn.send(("ok", (env.spec, size)))
        with socket.socket(fileno=os.dup(fd)) as sock:
            socket.send_fds(sock, [b"m"], [mfd])
        os.close(mfd)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:  # the parent is gone
            break
        if cmd == "close":
            break
        try:
            if cmd == "reset":
                obs = env.reset(arg)
                reply = obs["instruction"]
            elif cmd == "step":
                start = time.perf_counter()
                res = env.chunk_step(arg)
                obs = res.obs
                reply = (res.reward, res.terminated, res.truncated, res.info, time.perf_counter() - start)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            views["image"][...] = obs["image"]
            views["state"][...] = obs["state"]
            conn.send(("ok", reply))
        except Exception:
            conn.send(("error", traceback.format_exc()))
            break
    env.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
