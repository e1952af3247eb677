"""rlnode taskapp-gateway: the Task App registry, managed Task App processes and authenticated rollout calls."""
