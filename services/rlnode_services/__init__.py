"""rlnode's five services, one package each (`python -m rlnode_services.<name>`). No service
imports another's package: what they share is in `rlnode`."""
