"""`launch_crew`: the three steps of bringing a crew up, as one call that rolls back as a whole.

The provider's calls each undo their own work on failure; across calls, the rollback is here:
if attaching the network or starting the agent fails, the infra container (and anything else
of the crew) is removed before the error propagates. The attach step is the caller's
(netns.CrewNetworks.attach, rules before the veth); it is passed in so that this module needs
nothing from netns/ and the tests can drive it with a real CrewNetworks.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import CrewSpec, Pod, RuntimeProvider
from .errors import CrewContainerError


def launch_crew(
    provider: RuntimeProvider, spec: CrewSpec, attach: Callable[[Pod], object]
) -> tuple[Pod, str]:
    """create_infra, attach(pod), start_agent; the pod and the agent container's id.

    On failure after the infra exists, `provider.remove_crew(spec.name)` runs (volumes that
    existed before are kept) and the error propagates; a failure of that cleanup is added to
    the error's notes. The caller detaches the network if `attach` had succeeded.
    """
    pod = provider.create_infra(spec)
    try:
        attach(pod)
        agent = provider.start_agent(spec, pod)
    except BaseException as exc:
        try:
            provider.remove_crew(spec.name)
        except CrewContainerError as cleanup:
            exc.add_note(f"and removing the crew's containers failed: {cleanup}")
        raise
    return pod, agent
