"""Runs once in the base machine: load the simulator and fill the caches.

Imports gymnasium and numpy (their bytecode compiled and their files in the page
cache), builds the environment and plays a throwaway episode, so that every fork
starts warm instead of at `pip install`.
"""

import time

started = time.perf_counter()
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

env = gym.make("CartPole-v1")
env.reset(seed=0)
for _ in range(200):
    _, _, terminated, truncated, _ = env.step(env.action_space.sample())
    if terminated or truncated:
        env.reset()
env.close()
np.linalg.svd(np.random.default_rng(0).random((64, 64)))
print(f"warm-up done in {time.perf_counter() - started:.2f} s")
