"""Flow control: when no worker of a model can take a request now, it waits in a bounded
queue, served by priority class, fairly between tenants, first come first served within
a tenant, instead of being refused at once."""
