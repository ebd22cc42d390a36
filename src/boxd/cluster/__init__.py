"""boxd across many hosts, on a Ray cluster (the optional ``boxd[ray]`` extra).

Every Ray node that offers the ``boxd_host`` resource runs one host agent (``HostAgent``):
a detached, named actor pinned to its node that owns the node's VMs through a
``LocalRuntime`` of its own. The daemon talks to them through ``RayRuntime``, which is
one more implementation of the runtime interface: it places new machines by what the
agents report, remembers which host owns which machine, and sends every call there.
Nothing in here knows about HTTP; nothing outside it knows about Ray.
"""
