"""Discovery: workers that come and go from DNS, Kubernetes and a watched file.

Each source (`dns`, `kubernetes`, `file`) reports the whole set of hosts it knows each
time it knows it; `Membership` turns the reports of every source into the fleet's one
door (add, name, put out of service, drain and remove). With `--processes N` the sources
run once, in the supervisor, and each serving process applies their reports.
"""
