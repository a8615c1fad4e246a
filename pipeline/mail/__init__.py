"""The e-mail: MIME building, pools of SMTP connections with their breakers and retries, the
relays' logs, and the local test relay. No Redis, no storage, no Ray: the stages record what
happened."""
