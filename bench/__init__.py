"""The measurements behind every performance claim (docs/BENCHMARKS.md).

- cli.py      `attnserve bench <name>`: dispatches to a command
- commands/   the benchmark commands, one module per `attnserve bench <name>` (listed in its __init__)
- peers/      the other engines `bench compare` and `bench g2p` measure, each run by the peer protocol
- the modules here, beside cli.py, are the helpers the commands share:
  - machine.py         what a benchmark ran on; `publish()` writes its JSON and its BENCHMARKS.md section
  - fleet.py           replicas of one model, each `attnserve serve` in a child process (`ServerProcess`)
  - g2p_score.py       `attnserve score-g2p`: the served G2P model's test WER and PER (greedy, beams), into its card
  - load_clients.py    clients that stream request after request until stopped, each request recorded
  - nbits_invariance.py  `python -m bench.nbits_invariance`: whether 4-bit MatMulNBits gives a row the same bits
                       alone and batched, by block size, accuracy level, threads and padding (a diagnostic)
  - nginx.py           nginx in front of a fleet, configured by deploy/nginx/attnserve.conf.template
  - noop_server.py     a server that generates nothing (`python -m bench.noop_server`), for `bench serve --noop-check`
  - op_profile.py      `python -m bench.op_profile`: a decode step's time by operator (a diagnostic, not a bench)
  - plots.py           the PNG plots of the results
  - real_report.py     `bench compare --real-shapes`: decode rates, medians, skip rules, targets, its report
  - real_runs.py       `bench compare --real-shapes`: attnserve and llama.cpp measured at one shape's points
  - replicas.py        the runs against a fleet: a rolling update, a killed replica, capacity (tests, `bench replicas`)
  - roofline.py        the bytes a batch-1 decode step reads, and the tokens/s the read bandwidth allows for them
  - serve_http.py      the load generator's HTTP client (`bench serve --protocol http`)
  - sizes.py           the three model sizes the comparisons run, prepared for every system
  - stagger.py         when the load generator's clients start
  - stats.py           latency and throughput accounting over request records
  - workload.py        the requests a benchmark sends, from a fixed seed
"""
