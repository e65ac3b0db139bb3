// An Agent-Reach caller in Node.js: one call, its outcome printed as one JSON line.
//
//   node caller.js CREDS_FILE CAPABILITY '{"a": 1, "b": 2}'
//
// It gets a fabric token and a call token per instance (the two-step token flow), finds
// the capability's instances in the registry (KV bucket REACH_REGISTRY, keys
// agent.<agent_id>), and calls the least busy one, moving on to the next with the same
// call id when one answers "unavailable". Prints {"ok": true, "result", "by"} or
// {"ok": false, "kind", "code", "desc"} (exit status 1).
import { setTimeout as sleep } from "node:timers/promises";
import { WireError, ask, bodyOf, callToken, decode, fabricToken, login, random, request } from "./wire.js";

const [credsPath, capability, payload = "{}"] = process.argv.slice(2);
const { nc, creds } = await login(credsPath);
const js = nc.jetstream();
const registry = await js.views.kv("REACH_REGISTRY"); // a standard kv(): no workarounds needed
const jsm = await nc.jetstreamManager();

// Live, ready instances of the capability, least busy first. The keys are listed from
// the stream's subjects: kv.keys() and kv.watch() make JetStream consumers, which no
// caller may create (changes are republished on reach.v1.kv.REACH_REGISTRY.<key>).
async function instances() {
  const info = await jsm.streams.info("KV_REACH_REGISTRY", { subjects_filter: "$KV.REACH_REGISTRY.agent.>" });
  const found = [];
  for (const subject of Object.keys(info.state.subjects ?? {})) {
    const entry = await registry.get(subject.slice("$KV.REACH_REGISTRY.".length));
    if (!entry || entry.operation !== "PUT") continue;
    const record = decode(entry.value);
    const serves = record.manifest.capabilities.some((cap) => cap.name === capability);
    if (serves && record.status !== "unhealthy" && record.readiness?.ready !== false) found.push(record);
  }
  return found.sort((x, y) => (x.in_flight ?? 0) - (y.in_flight ?? 0)).map((r) => r.manifest.agent_id);
}

async function call(input, timeout = 5000) {
  const fabric = await fabricToken(nc, creds);
  let targets = await instances();
  for (let i = 0; i < 50 && targets.length === 0; i++) { // a new agent: wait up to 10 s
    await sleep(200);
    targets = await instances();
  }
  const id = random() + random(); // one call id for every attempt: a callee may deduplicate
  let last = new WireError("unavailable", "not_found", `no instance of ${capability}`);
  for (const [n, instance] of targets.slice(0, 3).entries()) {
    const { token } = await callToken(nc, creds, fabric.token, capability, instance);
    const data = request(input, { id, tok: token, dl: Date.now() + timeout, at: n + 1 });
    try {
      const reply = await ask(nc, creds.client_id, `reach.v1.cap.${capability}.${instance}`, data, timeout);
      return { result: bodyOf(reply), by: decode(reply).by };
    } catch (err) {
      if (!(err instanceof WireError) || err.kind !== "unavailable") throw err;
      last = err; // not ready, at capacity, or gone: the next instance
    }
  }
  throw last;
}

try {
  const { result, by } = await call(JSON.parse(payload));
  console.log(JSON.stringify({ ok: true, result, by }));
} catch (err) {
  if (!(err instanceof WireError)) throw err;
  console.log(JSON.stringify({ ok: false, kind: err.kind, code: err.code, desc: err.desc }));
  process.exitCode = 1;
} finally {
  await nc.close();
}
