// The Agent-Reach wire protocol, as the caller and the agent here share it: logging in,
// the msgpack envelope, call-reply subjects and the two-step token flow.
import { readFileSync } from "node:fs";
import { randomBytes } from "node:crypto";
import { connect } from "nats";
import { encode, decode } from "@msgpack/msgpack";

export { encode, decode };

// A credentials file is JSON {url, client_id, secret}. NATS login: user = client id,
// password = secret, and the inbox prefix must be _INBOX.<client_id> (the only inbox
// the client may listen on).
export async function login(credsPath) {
  const creds = JSON.parse(readFileSync(credsPath, "utf8"));
  const nc = await connect({
    servers: creds.url,
    user: creds.client_id,
    pass: creds.secret,
    inboxPrefix: `_INBOX.${creds.client_id}`,
    name: creds.client_id,
  });
  return { nc, creds };
}

export const random = () => randomBytes(8).toString("hex");

// Every request is a msgpack map {v: 1, id, b, tok?, dl?, at?, from?}; the body b is
// msgpack too, carried as bin bytes. Optional keys are left out, never sent as nil.
export function request(body, meta = {}) {
  const env = { v: 1, id: random(), b: encode(body) };
  for (const [key, value] of Object.entries(meta)) if (value != null) env[key] = value;
  return encode(env);
}

export const ok = (body, by, extra = {}) => encode({ v: 1, ok: true, b: encode(body), by, ...extra });
export const fail = (kind, code, desc, by) => encode({ v: 1, ok: false, err: { kind, code, desc }, by });

export class WireError extends Error {
  constructor(kind, code, desc) {
    super(`${kind}/${code}: ${desc}`);
    Object.assign(this, { kind, code, desc });
  }
}

// The body of a reply envelope, or a WireError with its {kind, code, desc}.
export function bodyOf(data) {
  const env = decode(data);
  if (env?.v !== 1) throw new WireError("contract", "bad_reply", "not a version 1 reply");
  if (!env.ok) throw new WireError(env.err?.kind, env.err?.code ?? "", env.err?.desc ?? "");
  return decode(env.b);
}

// A request whose reply comes to a call-reply subject _INBOX.<client_id>.r.<base>.<token>
// (both random): agents may answer there and nowhere else in a client's inbox.
export async function ask(nc, clientId, subject, data, timeout = 5000) {
  const reply = `_INBOX.${clientId}.r.${random()}.${random()}`;
  try {
    return (await nc.request(subject, data, { timeout, noMux: true, reply })).data;
  } catch (err) {
    if (err.code === "503") throw new WireError("unavailable", "no_responders", `nobody serves ${subject}`);
    if (err.code === "TIMEOUT") throw new WireError("timeout", "timeout", `${subject}: no reply`);
    throw err;
  }
}

// The token service on reach.v1.auth.token, its requests wrapped in the envelope:
// step one, client id + secret for a fabric token; step two, the fabric token for a call
// token of one instance of a capability.
async function tokenService(nc, creds, fields) {
  const data = request({ client_id: creds.client_id, ...fields });
  return bodyOf(await ask(nc, creds.client_id, "reach.v1.auth.token", data));
}
export const fabricToken = (nc, creds) => tokenService(nc, creds, { secret: creds.secret });
export const callToken = (nc, creds, fabric, audience, instance) =>
  tokenService(nc, creds, { token: fabric, audience, instance });
