"""The speculation policy: how K is parsed, what the policy measures (costs, acceptance), and the choice of K
per step from those estimates."""
