// An Agent-Reach agent in Node.js: serves one capability, "a + b".
//
//   node agent.js CREDS_FILE AGENT_ID CAPABILITY [SECURITY_LEVEL]
//
// It verifies every call token (EdDSA, key pub.<kid> from REACH_KEYS), refuses a replayed
// request, answers a repeated call id of the same client from memory once its token is
// checked, checks input and output against the capability's JSON Schemas, answers
// failures as {kind, code, desc}, announces, heartbeats, answers probes, and records in
// REACH_AUDIT each call whose request does not say au (its replies then say aud: true).
import Ajv2020 from "ajv/dist/2020.js";
import { decodeProtectedHeader, importJWK, jwtVerify } from "jose";
import { bodyOf, decode, encode, fabricToken, fail, login, ok, random, request } from "./wire.js";

const [credsPath, agentId, name, levelText = "1"] = process.argv.slice(2);
const level = Number(levelText);
const capability = {
  name,
  description: "a + b",
  security_level: level,
  latency_sla_ms: 500,
  idempotent: true,
  input_schema: {
    type: "object",
    properties: { a: { type: "number" }, b: { type: "number" } },
    required: ["a", "b"],
    additionalProperties: false,
  },
  output_schema: { type: "object", properties: { sum: { type: "number" } }, required: ["sum"] },
};
const handler = async ({ a, b }) => ({ sum: a + b });

const ajv = new Ajv2020({ allErrors: false });
const checkInput = ajv.compile(capability.input_schema);
const checkOutput = ajv.compile(capability.output_schema);

const { nc, creds } = await login(credsPath);
const js = nc.jetstream();
const keys = await js.views.kv("REACH_KEYS"); // a standard kv(): no workarounds needed
const instanceId = random();
const startedAt = Date.now() / 1000; // every time on the wire is in Unix seconds...
let served = 0;
let lastCompletionAt = null; // ...this one too (null: nothing completed yet)
let fabric = await fabricToken(nc, creds);

// -- tokens: public keys pub.<kid> (msgpack {kid, alg, public_key, created_at, not_after})
const publicKeys = new Map();
async function publicKey(header) {
  if (header.alg !== "EdDSA") throw new Error("only EdDSA tokens");
  if (!publicKeys.has(header.kid)) {
    const entry = await keys.get(`pub.${header.kid}`);
    if (!entry || entry.operation !== "PUT") throw new Error(`unknown signing key ${header.kid}`);
    const record = decode(entry.value);
    const key = await importJWK({ kty: "OKP", crv: "Ed25519", x: record.public_key }, "EdDSA");
    publicKeys.set(header.kid, { key, notAfter: record.not_after ?? null });
  }
  return publicKeys.get(header.kid);
}
// a key's record changes (a rotation retires it): read it again when next needed
await nc.subscribe("reach.v1.kv.REACH_KEYS.pub.>", {
  callback: (_, msg) => publicKeys.delete(msg.subject.split(".").pop()),
});

async function verify(token, audience) {
  if (token == null) throw { kind: "denied", code: "no_token", desc: `${name} requires a token` };
  try {
    const { key, notAfter } = await publicKey(decodeProtectedHeader(token));
    const { payload } = await jwtVerify(token, key, {
      algorithms: ["EdDSA"], issuer: "reach", audience, clockTolerance: 30,
      requiredClaims: ["exp", "iat", "sub", "lvl"],
    });
    if (notAfter !== null && payload.exp > notAfter) throw new Error("signing key retired");
    return payload;
  } catch (err) {
    throw { kind: "denied", code: "authentication_failed", desc: `token rejected: ${err.message}` };
  }
}

// -- calls, in the order of the protocol's section 9.6
function contractError(errors) {
  const [e] = errors;
  const field = e.params.missingProperty ?? e.params.additionalProperty;
  const path = [e.instancePath.slice(1).replaceAll("/", "."), field].filter(Boolean).join(".");
  return { kind: "contract", code: e.keyword, desc: `${path || "<root>"}: ${e.message}` };
}

const MAX_AHEAD_MS = 24 * 3600 * 1000; // the furthest ahead a call's deadline may lie
const servedUntil = new Map(); // "client id at" -> deadline (ms): a replay is refused
const recent = new Map(); // "client key" -> reply: a repeat of a client's call, answered again

function forgetServed(now) {
  for (const [seen, until] of servedUntil) if (until < now) servedUntil.delete(seen);
}

async function serve(subject, env, claims, audited) {
  if (env.v !== 1) throw { kind: "contract", code: "version", desc: `protocol version ${env.v}` };
  // the token before anything else: no token, no work (and no reply from memory)
  const own = subject === `reach.v1.cap.${name}.${agentId}`; // else the queue subject
  Object.assign(claims, await verify(env.tok, own ? `call:${name}:${agentId}` : `call:${name}`));
  if (claims.lvl < level) {
    const desc = `${name} requires clearance level ${level}; holds ${claims.lvl}`;
    throw { kind: "denied", code: `insufficient_level:${level}:${claims.lvl}`, desc };
  }
  // the deadline (none: the agent's own, 1.5 x the SLA) and replay, per client
  const now = Date.now();
  const deadline = env.dl == null ? now + 1.5 * capability.latency_sla_ms : Number(env.dl);
  if (deadline > now + MAX_AHEAD_MS) {
    throw { kind: "denied", code: "deadline_too_far", desc: "the deadline lies over 24 h ahead" };
  }
  const seen = `${claims.sub} ${env.id} ${env.at}`;
  forgetServed(now);
  if (servedUntil.has(seen)) {
    throw { kind: "denied", code: "replayed", desc: `call ${env.id} attempt ${env.at} replayed` };
  }
  servedUntil.set(seen, deadline);
  if (deadline < now) {
    throw { kind: "timeout", code: "deadline_passed", desc: "the call's deadline has passed" };
  }
  // a repeat of a call this client made is answered as the first time
  const key = `${claims.sub} ${env.ik ?? env.id}`;
  if (recent.has(key)) return recent.get(key);
  const input = decode(env.b);
  if (!checkInput(input)) throw contractError(checkInput.errors);
  const output = await handler(input);
  if (!checkOutput(output)) throw { kind: "contract", code: "output", desc: "output breaks its schema" };
  served += 1;
  lastCompletionAt = Date.now() / 1000;
  const reply = ok(output, agentId, audited ? { aud: true } : {});
  recent.set(key, reply);
  if (recent.size > 4096) recent.delete(recent.keys().next().value);
  return reply;
}

async function onCall(msg) {
  const started = Date.now();
  const env = decode(msg.data);
  const claims = {};
  const audited = !env.au; // a caller that records its calls itself says au
  let reply, failure;
  try {
    reply = await serve(msg.subject, env, claims, audited);
  } catch (err) {
    failure = err.kind ? err : { kind: "internal", code: "Error", desc: String(err) };
    reply = fail(failure.kind, failure.code, failure.desc, agentId);
  }
  msg.respond(reply);
  if (audited) audit(env, claims, started, failure).catch(() => {}); // never fails a call
}

// One callee event, a batch of rows under the agent's own client id.
async function audit(env, claims, started, failure) {
  const fields = ["side", "ts", "capability", "call_id", "caller", "caller_agent", "callee",
    "outcome", "error", "code", "description", "latency_ms"];
  const outcome = !failure ? "ok" : failure.kind === "denied" ? "denied" : "error";
  const row = ["callee", started / 1000, name, env.id, claims.sub ?? "", env.from ?? null, agentId,
    outcome, failure?.kind ?? null, failure?.code ?? "", failure?.desc ?? "", Date.now() - started];
  const batch = { v: 4, fields, attempt_fields: ["agent_id", "score", "outcome", "latency_ms"], events: [row] };
  await js.publish(`reach.v1.audit.${name}.${creds.client_id}`, encode(batch));
}

const listen = (subject, callback, queue) => nc.subscribe(subject, { queue, callback: (_, msg) => callback(msg) });

// -- presence: subscribe first (the registrar probes a new instance at once), then announce
const control = (body) => request(body, { tok: fabric.token, from: agentId });
const load = () => ({ agent_id: agentId, instance_id: instanceId, in_flight: 0, max_concurrency: 64 });
listen(`reach.v1.probe.${agentId}`, (msg) =>
  msg.respond(ok({ ...load(), last_completion_at: lastCompletionAt, readiness: { ready: true } }, agentId)));
listen(`reach.v1.cap.${name}.${agentId}`, onCall);
listen(`reach.v1.cap.${name}`, onCall, name); // the queue group is the capability's name
await nc.flush();

async function announce() {
  const manifest = { agent_id: agentId, agent_name: "node-example", version: "1.0.0",
    capabilities: [capability], health: { interval_sec: 1, timeout_sec: 1 } };
  const body = { manifest, instance_id: instanceId, started_at: startedAt, readiness: { ready: true } };
  const answer = bodyOf((await nc.request(`reach.v1.announce.${agentId}`, control(body), { timeout: 5000 })).data);
  if (!answer.accepted) throw new Error(`announce refused: ${answer.reason}`);
}
await announce();
console.log(`ready ${agentId}`);

let seq = 0;
const beat = setInterval(async () => {
  try {
    if (fabric.expires_at - 60 < Date.now() / 1000) fabric = await fabricToken(nc, creds);
    const hb = { ...load(), seq: ++seq, sent_at: Date.now() / 1000, completed: served,
      last_completion_at: lastCompletionAt };
    const answer = bodyOf((await nc.request(`reach.v1.hb.${agentId}`, control(hb), { timeout: 2000 })).data);
    if (answer.reannounce) await announce();
  } catch { /* the registrar is away: the next beat tries again */ }
}, 1000);

process.on("SIGTERM", async () => {
  clearInterval(beat);
  await nc.request(`reach.v1.bye.${agentId}`, control({ agent_id: agentId, instance_id: instanceId }))
    .catch(() => {});
  await nc.drain();
  process.exit(0);
});
