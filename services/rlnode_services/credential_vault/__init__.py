"""rlnode credential-vault: orgs, tokens, org key pairs, sealed secrets and their audit trail."""
