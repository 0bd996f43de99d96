"""How the engine names the requests it makes from one (parallel samples, forks, beams): "0#1" is request 0's
second sample; and how many finished requests a snapshot keeps. No torch here: the window's process reads these
without loading the engine."""

SAMPLE_SEP, FORK_SEP, BEAM_SEP = "#", "+", "~"
MAX_FINISHED = 64  # finished requests a snapshot shows
