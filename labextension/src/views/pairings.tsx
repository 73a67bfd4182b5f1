/** Pairing requests waiting for the owner: name, scopes (narrowable), user code; approve/deny. */

import * as React from 'react';

import { age } from '../format';
import type { SidebarModel } from '../model';
import type { IPairing } from '../types';
import { Button, Empty, Section } from './common';

function PairingCard(props: { pairing: IPairing; model: SidebarModel }): React.ReactElement {
  const { pairing, model } = props;
  const [granted, setGranted] = React.useState<ReadonlySet<string>>(
    () => new Set(pairing.requested_scopes)
  );
  const busy = model.busy.has(`pairing:${pairing.id}`);
  const toggle = (scope: string): void => {
    const next = new Set(granted);
    if (next.has(scope)) {
      next.delete(scope);
    } else {
      next.add(scope);
    }
    setGranted(next);
  };
  const narrowed = granted.size < pairing.requested_scopes.length;
  const approve = (): void => {
    const scopes = pairing.requested_scopes.filter(s => granted.has(s));
    void model.approve(pairing.id, narrowed ? scopes : undefined);
  };
  const expiresIn = Math.max(0, Math.round(pairing.expires_at - Date.now() / 1000));
  return (
    <div
      className="jp-LMSP-pairing"
      data-pairing-id={pairing.id}
      data-user-code={pairing.user_code}
    >
      <div className="jp-LMSP-pairingHead">
        <span className="jp-LMSP-clientName">{pairing.client_name}</span>
        <code className="jp-LMSP-userCode" title="The code the client shows">
          {pairing.user_code}
        </code>
      </div>
      <div className="jp-LMSP-sub">
        asked {age(pairing.created_at)} ago · expires in {Math.ceil(expiresIn / 60)} min
      </div>
      <ul className="jp-LMSP-scopes">
        {pairing.requested_scopes.map(scope => (
          <li key={scope}>
            <label>
              <input
                type="checkbox"
                data-scope={scope}
                checked={granted.has(scope)}
                onChange={() => toggle(scope)}
              />{' '}
              {scope}
            </label>
          </li>
        ))}
      </ul>
      <div className="jp-LMSP-actions">
        <Button
          name="approve"
          kind="accept"
          label={narrowed ? 'Approve selected' : 'Approve'}
          title="Approve: the client receives a token with the checked scopes"
          disabled={busy || granted.size === 0}
          onClick={approve}
        />
        <Button
          name="deny"
          kind="warn"
          label="Deny"
          disabled={busy}
          onClick={() => void model.deny(pairing.id)}
        />
      </div>
    </div>
  );
}

export function PairingsView(props: { model: SidebarModel }): React.ReactElement {
  const { data, error, loaded } = props.model.pairings;
  return (
    <Section title="Pairing requests" name="pairings" count={data.length} error={error}>
      {data.length ? (
        data.map(p => <PairingCard key={p.id} pairing={p} model={props.model} />)
      ) : loaded ? (
        <Empty text="No client is waiting." />
      ) : null}
    </Section>
  );
}
