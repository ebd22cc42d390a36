"""The E2B-compatible API: unmodified code written for the ``e2b`` SDK runs on boxd.

Served as its own application under ``/e2b`` (its error shape is E2B's, not boxd's):
the control plane (``/sandboxes``, ``/v2/sandboxes``, ``/snapshots``) and envd (Connect
RPC, ``/files``, ``/health``), which the SDK reaches when ``E2B_API_URL`` and
``E2B_SANDBOX_URL`` both point there and which routes by the ``E2b-Sandbox-Id`` header.
Sandboxes are boxd machines; nothing here talks to QEMU.
"""
