/**
 * A JupyterLab notification for each pairing request that arrives while the sidebar is closed,
 * dismissed once the request is decided or expires.
 */

import { Notification } from '@jupyterlab/apputils';
import type { Widget } from '@lumino/widgets';

import type { SidebarModel } from './model';
import type { IPairing } from './types';

export function pairingMessage(p: IPairing): string {
  // The code first: a notification shows at most 140 characters.
  return `Pairing request ${p.user_code} from "${p.client_name}" for the language-model service: ${p.requested_scopes.join(', ')}`;
}

export function notifyPairings(
  model: SidebarModel,
  panel: Widget,
  reveal: () => void
): void {
  const shown = new Map<string, string>();
  model.pairingsArrived.connect((_, pairings) => {
    if (panel.isVisible) {
      return; // the user sees the request in the panel
    }
    for (const pairing of pairings) {
      const id = Notification.info(pairingMessage(pairing), {
        autoClose: false,
        actions: [
          {
            label: 'Review',
            caption: 'Open the language-model sidebar to approve or deny',
            displayType: 'accent',
            callback: () => reveal()
          }
        ],
        data: { lmspPairing: pairing.id, userCode: pairing.user_code }
      });
      shown.set(pairing.id, id);
    }
  });
  model.pairingsGone.connect((_, ids) => {
    for (const pairingId of ids) {
      const id = shown.get(pairingId);
      if (id !== undefined) {
        Notification.dismiss(id);
        shown.delete(pairingId);
      }
    }
  });
}
