"""spotctl, the operator's command line."""
