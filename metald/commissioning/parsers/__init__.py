"""Pure parsers of the tools' output the commissioning checks run: text in, a ``Verdict`` out.

Each one takes what the agent posted as the raw output (and the profile's expectations), so
metald recomputes the verdict itself instead of trusting the agent's.
"""
